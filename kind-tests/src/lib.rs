//! Test support for the offline checks of `kind/`: finding the CRDs, reading multi-document
//! YAML, and validating any object whose CRD is known with core's structural validator.
//!
//! The CRDs are vendored, unmodified, in `kind/crds` (see its README for their sources);
//! `PREFIXROUTE_CRDS_DIR` points the tests at another set, e.g. to try a newer release.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use prefixroute_pool as pool;
use prefixroute_pool::schema::{self, FieldError, NoCel, UnknownRules};
use serde::Deserialize;
use serde_json::Value;

/// The repository root (the workspace this crate belongs to).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("kind-tests sits in the repository root")
        .to_path_buf()
}

/// `$PREFIXROUTE_CRDS_DIR`, else `<repo>/kind/crds`. Panics with a clear message when the
/// CRDs are missing: these tests are meant to fail, not skip, without their reference data.
pub fn crds_dir() -> PathBuf {
    let dir = match std::env::var_os("PREFIXROUTE_CRDS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => repo_root().join("kind").join("crds"),
    };
    assert!(
        dir.join("inference.networking.k8s.io_inferencepools.yaml")
            .is_file(),
        "CRDs not found in {} (they ship in kind/crds; PREFIXROUTE_CRDS_DIR overrides the directory)",
        dir.display()
    );
    dir
}

/// Every document of a YAML file as JSON (empty documents dropped).
pub fn read_yaml(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    parse_yaml(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn parse_yaml(text: &str) -> Result<Vec<Value>, String> {
    let mut docs = Vec::new();
    for (i, document) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(document).map_err(|e| format!("document {}: {e}", i + 1))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// One served version of a CRD.
#[derive(Debug, Clone)]
pub struct CrdVersion {
    pub schema: Value,
    pub namespaced: bool,
    pub file: String,
}

/// The CRDs of a directory, by (`group/version`, kind).
#[derive(Debug, Default)]
pub struct Crds {
    pub versions: BTreeMap<(String, String), CrdVersion>,
}

impl Crds {
    pub fn load(dir: &Path) -> Crds {
        let mut crds = Crds::default();
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        files.sort();
        for file in files {
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            for crd in read_yaml(&file) {
                if crd.get("kind").and_then(Value::as_str) != Some("CustomResourceDefinition") {
                    continue;
                }
                let spec = &crd["spec"];
                let group = spec["group"].as_str().unwrap_or_default();
                let kind = spec["names"]["kind"].as_str().unwrap_or_default();
                let namespaced = spec["scope"].as_str() == Some("Namespaced");
                for v in spec["versions"].as_array().into_iter().flatten() {
                    if v["served"].as_bool() != Some(true) {
                        continue;
                    }
                    let version = v["name"].as_str().unwrap_or_default();
                    crds.versions.insert(
                        (format!("{group}/{version}"), kind.to_string()),
                        CrdVersion {
                            schema: v["schema"]["openAPIV3Schema"].clone(),
                            namespaced,
                            file: name.clone(),
                        },
                    );
                }
            }
        }
        crds
    }

    pub fn get(&self, api_version: &str, kind: &str) -> Option<&CrdVersion> {
        self.versions
            .get(&(api_version.to_string(), kind.to_string()))
    }
}

/// The outcome of validating one object against its CRD.
#[derive(Debug, Default)]
pub struct Checked {
    pub errors: Vec<String>,
    /// CEL rules that were not evaluated (only InferencePool's are implemented).
    pub skipped_rules: usize,
}

/// Validates an object against its CRD as the API server would (defaults, schema, metadata;
/// CEL for InferencePool only). `None` when no CRD in `crds` serves its apiVersion and kind.
pub fn check_custom_resource(crds: &Crds, object: &Value) -> Option<Checked> {
    let api_version = object.get("apiVersion")?.as_str()?;
    let kind = object.get("kind")?.as_str()?;
    let crd = crds.get(api_version, kind)?;
    if pool::is_inference_pool(object) {
        let errors = match pool::validate(object, "default") {
            Ok(_) => Vec::new(),
            Err(e) => vec![e.to_string()],
        };
        return Some(Checked {
            errors,
            skipped_rules: 0,
        });
    }
    let mut errors: Vec<FieldError> = schema::validate_object_meta(object, crd.namespaced);
    let (_, report) = schema::validate(&crd.schema, object, &NoCel, UnknownRules::Skip);
    errors.extend(report.errors);
    Some(Checked {
        errors: errors.iter().map(ToString::to_string).collect(),
        skipped_rules: report.skipped_rules.len(),
    })
}

/// Every YAML file under `kind/`, sorted, except the vendored CRDs in `kind/crds`: those are
/// the reference the manifests are checked against, not manifests of ours.
pub fn kind_yaml_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        if dir == repo_root().join("kind").join("crds") {
            return;
        }
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo_root().join("kind"), &mut out);
    out
}

/// Helm values files are not Kubernetes objects.
pub fn is_helm_values(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().ends_with(".values.yaml"))
}

/// The objects of the kind/ manifests (Helm values excluded), with their file.
pub fn kind_objects() -> Vec<(PathBuf, Value)> {
    kind_yaml_files()
        .into_iter()
        .filter(|p| !is_helm_values(p))
        .flat_map(|p| read_yaml(&p).into_iter().map(move |o| (p.clone(), o)))
        .collect()
}

/// The single object of `kind` named `name` among the kind/ manifests of `dir` (`base`,
/// `istio`, `envoy-gateway`).
pub fn find(dir: &str, kind: &str, name: &str) -> Value {
    let base = repo_root().join("kind").join(dir);
    let found: Vec<Value> = kind_objects()
        .into_iter()
        .filter(|(p, o)| {
            p.starts_with(&base)
                && o["kind"].as_str() == Some(kind)
                && o["metadata"]["name"].as_str() == Some(name)
        })
        .map(|(_, o)| o)
        .collect();
    assert_eq!(found.len(), 1, "expected one {kind} {name} in kind/{dir}");
    found.into_iter().next().unwrap_or(Value::Null)
}

/// What kind/up.sh's `render` does (its awk program): 64 zeros become `sha256`. Nothing else
/// is rendered: the plugin discovers the pool.
pub fn render(text: &str, sha256: &str) -> String {
    let zeros = "0".repeat(64);
    let mut out = String::new();
    for line in text.lines() {
        out.push_str(&line.replace(&zeros, sha256));
        out.push('\n');
    }
    out
}
