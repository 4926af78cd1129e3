//! The validator's compiled patterns (`regex-lite`) against the `regex` crate (RE2 semantics,
//! like Go's regexp that the API server uses) on every `pattern` of the CRDs, over random ASCII
//! strings.

use prefixroute_kind_tests::{crds_dir, Crds};
use prefixroute_pool::schema::{self, Regex};
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;

/// Every pattern of the CRDs, compiled by both engines (loaded once: the CRDs are large).
fn all_patterns() -> &'static [(String, Arc<Regex>, regex::Regex)] {
    static PATTERNS: OnceLock<Vec<(String, Arc<Regex>, regex::Regex)>> = OnceLock::new();
    PATTERNS.get_or_init(|| {
        let crds = Crds::load(&crds_dir());
        let mut all: Vec<String> = crds
            .versions
            .values()
            .flat_map(|crd| schema::patterns(&crd.schema))
            .collect();
        all.sort();
        all.dedup();
        all.into_iter()
            .map(|p| {
                let ours = schema::pattern(&p).unwrap();
                let reference = regex::Regex::new(&p).unwrap();
                (p, ours, reference)
            })
            .collect()
    })
}

/// Strings built from the characters these patterns care about (ASCII only: Go's `\w` and
/// `\d` are ASCII, the regex crate's are Unicode).
fn text() -> impl Strategy<Value = String> {
    let alphabet: Vec<char> = "aZz09-_.:/*%?#@!$&'()+,;=~`^|\\ \t\nhttpsmMiKGe"
        .chars()
        .collect();
    proptest::collection::vec(proptest::sample::select(alphabet), 0..24)
        .prop_map(|chars| chars.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn agrees_with_the_regex_crate(texts in proptest::collection::vec(text(), 16)) {
        for (pattern, ours, reference) in all_patterns() {
            for t in &texts {
                prop_assert_eq!(ours.is_match(t), reference.is_match(t), "pattern {:?} on {:?}", pattern, t);
            }
        }
    }
}

#[test]
fn agrees_on_typical_values() {
    let long = "a".repeat(64);
    let samples = [
        "",
        "a",
        "vllm-sim",
        "Service",
        "kubernetes.io/h2c",
        "example.com/path",
        "gateway.networking.k8s.io",
        "-bad",
        "bad-",
        "UPPER",
        "10s",
        "1h30m",
        "500ms",
        "x_y",
        "*.example.com",
        "http://a.b:80",
        "https://*",
        "Hostname",
        "a/b",
        "100Mi",
        "1.5",
        "+1e3",
        long.as_str(),
        "1.2.3.4",
    ];
    for (pattern, ours, reference) in all_patterns() {
        for s in samples {
            assert_eq!(
                ours.is_match(s),
                reference.is_match(s),
                "pattern {pattern:?} on {s:?}"
            );
        }
    }
}
