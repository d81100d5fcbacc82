//! Fuzzes the engines' `/metrics` parser: any body, read for each engine's
//! series and for the LoRA adapters in use, must give a load or a fault
//! (adapters or none) without panicking, the same answer twice, and the
//! same answer with a comment line and CRLF line ends added.
//!
//! Input layout: the whole input is one `/metrics` body.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::config::Engine;
use prefix_router::engine_load::metrics_text::{parse, MAX_BODY_BYTES};
use prefix_router::engine_load::models::active_adapters;

fuzz_target!(|body: &[u8]| {
    let active = active_adapters(body);
    assert_eq!(active_adapters(body), active);
    if body.len() + 16 <= MAX_BODY_BYTES && !body.contains(&b'\r') {
        let mut commented = b"# HELP x y\n".to_vec();
        commented.extend_from_slice(body);
        assert_eq!(active_adapters(&commented), active, "comment line");
        let crlf: Vec<u8> = body
            .iter()
            .flat_map(|b| if *b == b'\n' { vec![b'\r', b'\n'] } else { vec![*b] })
            .collect();
        if crlf.len() <= MAX_BODY_BYTES {
            assert_eq!(active_adapters(&crlf), active, "CRLF line ends");
        }
    }
    for engine in [Engine::Vllm, Engine::Sglang, Engine::Llamacpp] {
        let series = engine.series();
        let load = parse(body, &series);
        assert_eq!(parse(body, &series), load);
        if body.len() + 16 > MAX_BODY_BYTES || body.contains(&b'\r') {
            continue;
        }
        // A comment line before the body and CRLF line ends change nothing.
        let mut commented = b"# HELP x y\n".to_vec();
        commented.extend_from_slice(body);
        assert_eq!(parse(&commented, &series), load, "comment line");
        let crlf: Vec<u8> = body
            .iter()
            .flat_map(|b| if *b == b'\n' { vec![b'\r', b'\n'] } else { vec![*b] })
            .collect();
        if crlf.len() <= MAX_BODY_BYTES {
            assert_eq!(parse(&crlf, &series), load, "CRLF line ends");
        }
    }
});
