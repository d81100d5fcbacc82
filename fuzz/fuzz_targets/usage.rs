//! Fuzzes the response usage scanner: arbitrary bodies, as JSON or as an
//! event stream, in three chunkings (one piece, one byte at a time, and
//! pieces cut where the input's first bytes say). None may panic, the state
//! is a fixed size, and every chunking gives the same usage.
//!
//! Input layout: byte 0 bit 0 the framing (1: event stream), bytes 1..=8
//! the seed of the random cuts, the rest the body.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::usage::{scan, Framing, UsageScanner};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let (seed, body) = rest.split_at(rest.len().min(8));
    let framing = if flags & 1 == 1 {
        Framing::EventStream
    } else {
        Framing::Json
    };
    let whole = scan(framing, body);

    let mut bytewise = UsageScanner::new(framing);
    for byte in body {
        bytewise.feed(std::slice::from_ref(byte));
    }
    assert_eq!(bytewise.finish(), whole, "byte by byte");

    // Pieces of 0 to 63 bytes, from an xorshift of the seed.
    let mut state = seed
        .iter()
        .fold(0x9E37_79B9_7F4A_7C15u64, |s, b| (s << 8) ^ u64::from(*b) ^ (s >> 56))
        | 1;
    let mut pieces = UsageScanner::new(framing);
    let mut at = 0;
    while at < body.len() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let len = (state % 64) as usize;
        let end = (at + len).min(body.len());
        pieces.feed(&body[at..end]);
        at = end;
    }
    assert_eq!(pieces.finish(), whole, "random pieces");
    assert!(std::mem::size_of::<UsageScanner>() <= 256);
});
