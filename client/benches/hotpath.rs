//! Hot-path benchmarks (filled in below).
fn main() {}
