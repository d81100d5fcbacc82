//! Fuzzes the body extractor: arbitrary bodies, chunkings, API kinds and
//! limits must never panic, and the result must not depend on chunking.
//! The input layout and the properties checked are
//! `prefix_router::extract::fuzzing` (shared with the unit tests that replay
//! what this target found).

#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::extract::fuzzing::FuzzCase;

fuzz_target!(|data: &[u8]| {
    if let Some(case) = FuzzCase::decode(data) {
        case.run();
    }
});
