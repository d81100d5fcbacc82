use super::*;

const CHAT: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"The \"usage\": {\"prompt_tokens\": 7} is quoted \\","reasoning_content":null},"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":1536,"total_tokens":1544,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":1408}},"prompt_logprobs":null,"kv_transfer_params":null}"#;

/// The usage of `body` fed whole, byte by byte, and split at every boundary;
/// all must agree.
fn scanned(framing: Framing, body: &[u8]) -> Option<Usage> {
    let whole = scan(framing, body);
    let mut bytewise = UsageScanner::new(framing);
    for byte in body {
        bytewise.feed(std::slice::from_ref(byte));
    }
    assert_eq!(bytewise.finish(), whole, "byte by byte");
    for at in 0..=body.len() {
        let mut split = UsageScanner::new(framing);
        split.feed(&body[..at]);
        split.feed(&[]);
        split.feed(&body[at..]);
        assert_eq!(split.finish(), whole, "split at {at}");
    }
    whole
}

fn json(body: &str) -> Option<Usage> {
    scanned(Framing::Json, body.as_bytes())
}

fn events(body: &str) -> Option<Usage> {
    scanned(Framing::EventStream, body.as_bytes())
}

fn usage(prompt_tokens: u64, cached_tokens: Option<u64>) -> Option<Usage> {
    Some(Usage {
        prompt_tokens,
        cached_tokens,
    })
}

#[test]
fn a_vllm_chat_response_reports_its_cached_tokens_at_any_split() {
    assert_eq!(json(CHAT), usage(1536, Some(1408)));
    let pretty = CHAT.replace(',', " ,\n\t").replace(':', "\r\n : ");
    assert_eq!(json(&pretty), usage(1536, Some(1408)));
}

#[test]
fn absent_details_or_cached_tokens_are_unknown_not_zero() {
    assert_eq!(json(r#"{"usage":{"prompt_tokens":12}}"#), usage(12, None));
    assert_eq!(
        json(r#"{"usage":{"prompt_tokens_details":null,"prompt_tokens":12}}"#),
        usage(12, None)
    );
    assert_eq!(
        json(r#"{"usage":{"prompt_tokens_details":{},"prompt_tokens":12}}"#),
        usage(12, None)
    );
    assert_eq!(
        json(r#"{"usage":{"prompt_tokens_details":{"cached_tokens":0},"prompt_tokens":12}}"#),
        usage(12, Some(0))
    );
    // Details before the prompt tokens, other keys around.
    assert_eq!(
        json(
            r#"{"usage":{"prompt_tokens_details":{"audio_tokens":3,"cached_tokens":5,"x":[1,{"cached_tokens":9}]},"prompt_tokens":12},"z":1}"#
        ),
        usage(12, Some(5))
    );
}

#[test]
fn no_usage_or_no_prompt_tokens_is_no_usage() {
    assert_eq!(json(r#"{"id":"x","usage":null}"#), None);
    assert_eq!(json(r#"{"id":"x"}"#), None);
    assert_eq!(json(r#"{"usage":{}}"#), None);
    assert_eq!(
        json(r#"{"usage":{"prompt_tokens_details":{"cached_tokens":5}}}"#),
        None
    );
    assert_eq!(json(r#"{"usage":{"prompt_tokens":"12"}}"#), None);
    assert_eq!(json(r#"{"usage":{"prompt_tokens":null}}"#), None);
    assert_eq!(json(r#"{"usage":[{"prompt_tokens":12}]}"#), None);
    assert_eq!(json(""), None);
}

#[test]
fn a_usage_key_anywhere_but_the_top_level_does_not_match() {
    assert_eq!(
        json(
            r#"{"choices":[{"usage":{"prompt_tokens":99}}],"meta":{"usage":{"prompt_tokens":98}}}"#
        ),
        None
    );
    assert_eq!(
        json(r#"{"content":"\"usage\":{\"prompt_tokens\":1}","usage2":{"prompt_tokens":1}}"#),
        None
    );
    assert_eq!(
        json(
            r#"{"prompt_tokens":5,"usage":{"usage":{"prompt_tokens":4},"cached_tokens":3,"prompt_tokens":2}}"#
        ),
        usage(2, None)
    );
    // An escaped key is not recognised (vLLM never writes one).
    assert_eq!(json(r#"{"\u0075sage":{"prompt_tokens":1}}"#), None);
    assert_eq!(json(r#"{"us\"age":{"prompt_tokens":1}}"#), None);
    // A key longer than any of ours that starts like one.
    assert_eq!(
        json(r#"{"usage_and_then_some_more_bytes":{"prompt_tokens":1}}"#),
        None
    );
    // A string value equal to a key, where a key would be a value.
    assert_eq!(json(r#"{"a":"usage","b":{"prompt_tokens":1}}"#), None);
}

#[test]
fn escapes_and_backslashes_inside_strings_do_not_end_them() {
    assert_eq!(
        json(r#"{"a":"\\","b":"\\\"}","usage":{"prompt_tokens":3}}"#),
        usage(3, None)
    );
    assert_eq!(
        json(r#"{"a":"\"usage\":{","usage":{"prompt_tokens":3,"s":"}}}"}}"#),
        usage(3, None)
    );
}

#[test]
fn numbers_at_the_edges() {
    let max = u64::MAX;
    assert_eq!(
        json(&format!(
            r#"{{"usage":{{"prompt_tokens":{max},"prompt_tokens_details":{{"cached_tokens":0}}}}}}"#
        )),
        usage(max, Some(0))
    );
    assert_eq!(
        json(r#"{"usage":{"prompt_tokens":18446744073709551616}}"#),
        None
    );
    assert_eq!(json(r#"{"usage":{"prompt_tokens":-1}}"#), None);
    assert_eq!(json(r#"{"usage":{"prompt_tokens":1.5}}"#), None);
    assert_eq!(json(r#"{"usage":{"prompt_tokens":1e3}}"#), None);
    assert_eq!(json(r#"{"usage":{"prompt_tokens":0}}"#), usage(0, None));
    assert_eq!(
        json(r#"{"usage":{"prompt_tokens":4,"prompt_tokens_details":{"cached_tokens":2.0}}}"#),
        usage(4, None)
    );
}

#[test]
fn malformed_truncated_or_trailing_bodies_give_no_usage() {
    for body in [
        r#"{"usage":{"prompt_tokens":3}"#,
        r#"{"usage":{"prompt_tokens":3}}}"#,
        r#"{"usage":{"prompt_tokens":3}} x"#,
        r#"{"usage":{"prompt_tokens":3}}{"usage":{"prompt_tokens":4}}"#,
        r#"[{"usage":{"prompt_tokens":3}}]"#,
        r#"x{"usage":{"prompt_tokens":3}}"#,
        r#"{"usage":{"prompt_tokens":3]}"#,
        r#"{"usage":{"prompt_tokens":3},"s":"unterminated}"#,
    ] {
        assert_eq!(json(body), None, "{body}");
    }
    assert_eq!(
        json("\n {\"usage\":{\"prompt_tokens\":3}} \n"),
        usage(3, None)
    );
}

#[test]
fn hostile_bodies_keep_the_state_small() {
    let deep = "[".repeat(1 << 20);
    assert_eq!(
        scan(Framing::Json, format!("{{\"a\":{deep}").as_bytes()),
        None
    );
    let long_key = format!("{{\"{}\":1}}", "k".repeat(1 << 20));
    assert_eq!(scan(Framing::Json, long_key.as_bytes()), None);
    assert_eq!(scan(Framing::EventStream, deep.as_bytes()), None);
    assert_eq!(scan(Framing::EventStream, &vec![b'\n'; 1 << 16]), None);
    // Fixed-size state, no heap, whatever was fed.
    assert!(std::mem::size_of::<UsageScanner>() <= 256);
}

const STREAM_HEAD: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"usage: {\\\"prompt_tokens\\\":1}\"}}],\"usage\":null}\n\n";

#[test]
fn a_stream_reports_the_last_event_with_a_usage() {
    let final_chunk = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1536,\"total_tokens\":1544,\"completion_tokens\":8,\"prompt_tokens_details\":{\"cached_tokens\":1408}}}\n\n";
    let body = format!("{STREAM_HEAD}{STREAM_HEAD}{final_chunk}data: [DONE]\n\n");
    assert_eq!(events(&body), usage(1536, Some(1408)));
    let crlf = body.replace('\n', "\r\n");
    assert_eq!(events(&crlf), usage(1536, Some(1408)));
    let bare_cr = body.replace('\n', "\r");
    assert_eq!(events(&bare_cr), usage(1536, Some(1408)));
    // No space after the colon; comments and other fields between.
    let tight = format!(
        ": ping\nevent: x\nid: 3\n{}",
        final_chunk.replacen("data: ", "data:", 1)
    );
    assert_eq!(events(&tight), usage(1536, Some(1408)));
    // The later usage wins; a later null changes nothing.
    let two = format!(
        "{final_chunk}data: {{\"usage\":{{\"prompt_tokens\":2}}}}\n\n{STREAM_HEAD}data: [DONE]\n\n"
    );
    assert_eq!(events(&two), usage(2, None));
    // The stream ends without the blank line.
    assert_eq!(events(final_chunk.trim_end()), usage(1536, Some(1408)));
}

#[test]
fn a_stream_without_a_usage_chunk_reports_none() {
    let body = format!("{STREAM_HEAD}{STREAM_HEAD}data: [DONE]\n\n");
    assert_eq!(events(&body), None);
    assert_eq!(events("data: [DONE]\n\n"), None);
    assert_eq!(events(""), None);
}

#[test]
fn a_malformed_event_reports_nothing_and_spoils_no_other() {
    let good = "data: {\"usage\":{\"prompt_tokens\":5}}\n\n";
    for bad in [
        "data: {\"usage\":{\"prompt_tokens\":6}\n\n",
        "data: {\"usage\":{\"prompt_tokens\":6}} x\n\n",
        "data: {\"s\":\"raw\nline\",\"usage\":{\"prompt_tokens\":6}}\n\n",
        "data: {\"usage\":{\"prompt_tokens\":6}}\ndata: {}\n\n",
        "xdata: {\"usage\":{\"prompt_tokens\":6}}\n\n",
        "dat {\"usage\":{\"prompt_tokens\":6}}\n\n",
    ] {
        assert_eq!(events(&format!("{good}{bad}")), usage(5, None), "{bad:?}");
    }
    // One event's data over two lines joins into one value.
    assert_eq!(
        events("data: {\"usage\":\ndata: {\"prompt_tokens\":6}}\n\n"),
        usage(6, None)
    );
}

#[test]
fn the_framing_follows_the_content_type() {
    assert_eq!(
        Framing::of_content_type(Some(b"text/event-stream; charset=utf-8")),
        Framing::EventStream
    );
    assert_eq!(
        Framing::of_content_type(Some(b"Text/Event-Stream")),
        Framing::EventStream
    );
    assert_eq!(
        Framing::of_content_type(Some(b"application/json")),
        Framing::Json
    );
    assert_eq!(Framing::of_content_type(None), Framing::Json);
    // A JSON body read as events, or events as JSON, reports nothing.
    assert_eq!(scan(Framing::EventStream, CHAT.as_bytes()), None);
    assert_eq!(
        scan(
            Framing::Json,
            b"data: {\"usage\":{\"prompt_tokens\":5}}\n\n"
        ),
        None
    );
}

#[test]
fn events_skipped_whole_report_what_a_scan_of_every_byte_does() {
    // Events before the first possible usage object are skipped in one
    // step when a chunk holds them whole; byte by byte they are scanned.
    let body = concat!(
        "data: {\"usage\":null,\"k\":\"usage\",\"n\":[\"usage\"]}\r\n\r\n",
        ": comment \"usage\":{\n\n",
        "data: {\"usage\" : \n",
        "data: {\"prompt_tokens\":8}}\n\n",
        "data: {\"usage\":{\"prompt_tokens\":9}}\n\n",
        "data: {\"usage\":null}\n\n",
    );
    assert_eq!(events(body), usage(9, None));
    assert_eq!(events(&body[..body.len() - 52]), usage(8, None));
}

#[test]
fn a_carriage_return_inside_an_event_string_ends_its_line_at_any_split() {
    // Found by fuzzing: a chunk starting at the `\r` read it as a line end,
    // one piece as string content.
    let body = "data: {\"usage\":{\"prompt_tokens\":301,\"pr\r\0\0ens\":1}}\n\n";
    assert_eq!(events(body), None);
    let after = "data: {\"usage\":{\"prompt_tokens\":5}}\n\n";
    assert_eq!(events(&format!("{body}{after}")), usage(5, None));
}

#[test]
fn a_data_line_ending_inside_a_string_spoils_its_event_at_any_split() {
    // Found by fuzzing: a chunk starting at the line end joined the next
    // data line into the string; one piece failed the event.
    let body = "data: {\"usage\":{\"prompt_tokens\":301,\"pr\ndata: x\":1}}\n\n";
    assert_eq!(events(body), None);
}
