//! `cargo xtask bench`, fuzzing part: the parsers' property tests run long.
use anyhow::Result;

use crate::say;

/// Cases per property in the bench's long fuzzing run (the test suite runs 256).
const FUZZ_CASES: &str = "100000";

/// The parsers' property tests (`profiler/src/fuzz_tests.rs`) with many more
/// cases than the test suite gives them, and how long that took.
pub fn fuzz_long() -> Result<()> {
    say(format!("bench: fuzzing the parsers, {FUZZ_CASES} cases per property"));
    let t0 = std::time::Instant::now();
    crate::run(
        crate::cargo()
            .current_dir(crate::root())
            .args(["test", "--release", "-p", "profiler", "fuzz_", "--", "--test-threads=2"])
            .env("PROFILER_FUZZ_CASES", FUZZ_CASES),
    )?;
    println!();
    println!(
        "Parser fuzzing: {FUZZ_CASES} cases per property, no panic, every invariant held, in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
