//! The access-log snippet in docs/troubleshooting.md is accepted by Envoy
//! where the page says to put it.
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use serde_yaml::Value;

use support::*;

/// The access-log snippet in docs/troubleshooting.md is accepted by Envoy
/// where the page says to put it.
#[test]
fn troubleshooting_access_log_snippet_passes_envoy_validate() {
    let doc = read("docs/troubleshooting.md");
    let start = doc.find("```yaml\n").expect("no yaml block") + "```yaml\n".len();
    let end = start + doc[start..].find("```").unwrap();
    let snippet: Value = serde_yaml::from_str(&doc[start..end]).expect("snippet is not YAML");
    assert!(doc[start..end].contains("%REQ(X-PREFIX-ROUTE-KEY)%"));
    let mut config = yaml("envoy/envoy.yaml");
    set_wasm_filename(&mut config, &built_wasm());
    let hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]
        .as_mapping_mut()
        .unwrap();
    for (k, v) in snippet.as_mapping().unwrap() {
        hcm.insert(k.clone(), v.clone());
    }
    assert_envoy_accepts(&config, "envoy/envoy.yaml with the access-log snippet");
}
