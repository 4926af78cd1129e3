//! Endpoints whose answers are server errors leave the rotation for a while (core's `outlier`),
//! whatever their scrapes say.

use host_tests::{CalloutReply, Headers, Request, Vm};
use serde_json::json;

use crate::common::{self, chat_body, config, destination, endpoint_of, page, tenant_prompt};

/// Sends a new tenant's request, answers it with `status(endpoint)` and finishes it; returns
/// the endpoint it went to.
fn route_answered(vm: &mut Vm, tenant: usize, status: impl Fn(usize) -> u16) -> usize {
    let x = vm
        .send(&Request::chat(chat_body(&tenant_prompt(tenant), "hello")))
        .unwrap();
    let e = endpoint_of(&destination(&x));
    vm.respond(x.id, status(e)).unwrap();
    vm.finish(x.id).unwrap();
    e
}

/// `count` new tenants' requests 10 ms apart from `first`, each answered with `status`; how
/// many went to each of `n` endpoints.
fn spread(
    vm: &mut Vm,
    host: &host_tests::Host,
    n: usize,
    (first, count): (usize, usize),
    status: impl Fn(usize) -> u16,
) -> Vec<usize> {
    let mut hits = vec![0; n];
    for t in first..first + count {
        hits[route_answered(vm, t, &status)] += 1;
        host.clock().advance_ms(10);
    }
    hits
}

/// Three endpoints whose scrapes all say idle; endpoint 2's engine is dead: it answers 503.
fn idle_fleet(host: &host_tests::Host) -> Vm {
    let mut vm = common::configured(host, &config(3, json!({})));
    common::tick_and_answer(&mut vm, |_| CalloutReply::ok(page(0.0, 0.0, 0.0)));
    vm
}

#[test]
fn an_endpoint_that_answers_five_server_errors_in_a_row_gets_nothing_for_thirty_seconds() {
    let host = common::host();
    let mut vm = idle_fleet(&host);
    let dead = |e: usize| if e == 2 { 503 } else { 200 };
    let hits = spread(&mut vm, &host, 3, (0, 90), dead);
    assert_eq!(hits[2], 5, "only the errors that eject it: {hits:?}");
    assert_eq!(host.stats().value("prefixroute.endpoint_ejected"), 1);
    assert_eq!(
        vm.capture()
            .logs_containing(
                host_tests::LogLevel::Warn,
                "failed 5 requests in a row; out of rotation for 30 s"
            )
            .len(),
        1
    );
    // Its scrapes still say idle: the scrape does not bring it back. Its gauge says it is out.
    common::tick_and_answer(&mut vm, |_| CalloutReply::ok(page(0.0, 0.0, 0.0)));
    let down = |host: &host_tests::Host| {
        let gauge = format!("prefixroute.endpoint.{}.down", common::name(2));
        host.stats().value(&gauge)
    };
    assert_eq!(down(&host), 1);
    assert_eq!(spread(&mut vm, &host, 3, (90, 30), dead)[2], 0);
    // Thirty seconds after the ejection it is back, and answers well now.
    host.clock().advance_ms(30_000);
    common::tick_and_answer(&mut vm, |_| CalloutReply::ok(page(0.0, 0.0, 0.0)));
    assert_eq!(down(&host), 0);
    let back = spread(&mut vm, &host, 3, (120, 30), |_| 200);
    assert!(back[2] >= 5, "back in rotation: {back:?}");
}

#[test]
fn client_errors_never_take_an_endpoint_out() {
    let host = common::host();
    let mut vm = idle_fleet(&host);
    let hits = spread(
        &mut vm,
        &host,
        3,
        (0, 60),
        |e| if e == 2 { 400 } else { 200 },
    );
    assert!(hits[2] >= 10, "{hits:?}");
    assert_eq!(host.stats().value("prefixroute.endpoint_ejected"), 0);
}

#[test]
fn when_every_endpoint_answers_server_errors_requests_still_get_a_destination() {
    let host = common::host();
    let mut vm = idle_fleet(&host);
    // Each is ejected after its fifth error; once all are out, the router routes among them
    // as among endpoints that are all down, rather than refusing requests.
    let hits = spread(&mut vm, &host, 3, (0, 60), |_| 502);
    assert_eq!(hits.iter().sum::<usize>(), 60);
    assert_eq!(host.stats().value("prefixroute.endpoint_ejected"), 3);
}

/// How a response tells the plugin the tries Envoy's router made.
#[derive(Clone, Copy)]
enum AttemptCount {
    /// Envoy's `upstream.request_attempt_count` attribute (Envoy 1.33 and later).
    Attribute,
    /// Only `x-envoy-attempt-count` (`include_attempt_count_in_response`): not what the
    /// plugin reads.
    Header,
}

/// Endpoint 2 fails every try it gets; Envoy's route retries on the next endpoint of the
/// destination header, which answers, and the response reports the tries as `report` says.
/// The client sees only successes. Returns how many requests tried each endpoint first, and
/// the latency model's observations (used and refused).
fn retried_away(report: AttemptCount) -> (Vec<usize>, host_tests::Host, i64) {
    let host = common::host();
    let mut vm = idle_fleet(&host);
    let mut first_tries = vec![0; 3];
    for t in 0..90 {
        let x = vm
            .send(&Request::chat(chat_body(&tenant_prompt(t), "hello")))
            .unwrap();
        let listed: Vec<usize> = common::destinations(&x)
            .iter()
            .map(|a| endpoint_of(a))
            .collect();
        first_tries[listed[0]] += 1;
        let attempts = if listed[0] == 2 { 2 } else { 1 };
        let mut h = Headers::new();
        h.add(":status", b"200");
        match report {
            AttemptCount::Header => h.add("x-envoy-attempt-count", attempts.to_string().as_bytes()),
            AttemptCount::Attribute => vm.set_attempt_count(x.id, attempts).unwrap(),
        }
        vm.response_headers(x.id, h, false).unwrap();
        vm.response_body(x.id, b"{}", true).unwrap();
        vm.finish(x.id).unwrap();
        host.clock().advance_ms(10);
    }
    let observed = host.stats().value("prefixroute.latency.observations")
        + host
            .stats()
            .value("prefixroute.latency.observations_refused");
    (first_tries, host, observed)
}

#[test]
fn tries_that_envoy_retried_away_count_against_their_endpoint() {
    let (first_tries, host, observed) = retried_away(AttemptCount::Attribute);
    // The plugin still takes endpoint 2 out after five.
    assert_eq!(first_tries[2], 5, "{first_tries:?}");
    assert_eq!(host.stats().value("prefixroute.endpoint_ejected"), 1);
    // What endpoint 0 or 1 answered after a retry teaches nothing of endpoint 2's rate.
    assert_eq!(observed, 85);
}

#[test]
fn the_attempt_count_header_alone_is_not_read() {
    // The attribute is on every Envoy the plugin runs on (1.35 and later); the header needs
    // the virtual host's `include_attempt_count_in_response`. A host that gave only the header
    // would leave retried tries invisible: endpoint 2 seems to answer well every time.
    let (first_tries, host, observed) = retried_away(AttemptCount::Header);
    assert!(first_tries[2] > 5, "{first_tries:?}");
    assert_eq!(host.stats().value("prefixroute.endpoint_ejected"), 0);
    assert_eq!(observed, 90);
}
