//! `cargo bench -p host-tests`: prints the cost table (exact counts, not timings).
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
