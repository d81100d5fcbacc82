//! Fuzzes the shared-data record decoders. Every value in shared data was
//! written by some worker VM, possibly of another build or half-corrupted,
//! so any bytes must decode (as each record kind) without panicking, and a
//! record that decodes must encode to bytes that decode to the same record.
//!
//! Input layout: the whole input is one shared-data value.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|value: &[u8]| {
    prefix_router::load::fuzzing::decode_as_every_record(value);
});
