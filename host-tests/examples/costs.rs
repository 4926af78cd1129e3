//! `cargo run -p host-tests --example costs`: the cost table of `cargo bench -p host-tests`
//! without building wasmtime under the release profile (the counts do not depend on it).
fn main() {
    // `cargo bench` passes `--bench`; there is nothing to filter.
    match host_tests::bench::run() {
        Ok((rows, ticks)) => print!("{}", host_tests::bench::render(&rows, &ticks)),
        Err(e) => {
            eprintln!("{e:?}");
            std::process::exit(1);
        }
    }
}
