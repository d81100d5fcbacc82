//! The README's Envoy excerpts are parts of `envoy/envoy.yaml`: every key and
//! value an excerpt shows is there, and each list item it shows matches an item
//! of the same list. So the minimal configuration a user copies from the README
//! cannot drift from the configuration the integration tests run.

mod support;

use serde_yaml::Value;

use support::*;

/// `part` is contained in `whole`: mappings key by key, list items each
/// matching some item of the other list, scalars equal.
fn contained(part: &Value, whole: &Value) -> bool {
    match (part, whole) {
        (Value::Mapping(part), Value::Mapping(whole)) => part
            .iter()
            .all(|(key, value)| whole.get(key).is_some_and(|w| contained(value, w))),
        (Value::Sequence(part), Value::Sequence(whole)) => part
            .iter()
            .all(|item| whole.iter().any(|w| contained(item, w))),
        _ => part == whole,
    }
}

/// `part` is contained in `whole` or in any node below it.
fn contained_somewhere(part: &Value, whole: &Value) -> bool {
    contained(part, whole)
        || match whole {
            Value::Mapping(map) => map.values().any(|v| contained_somewhere(part, v)),
            Value::Sequence(items) => items.iter().any(|v| contained_somewhere(part, v)),
            _ => false,
        }
}

#[test]
fn readme_envoy_excerpts_are_parts_of_envoy_yaml() {
    let readme = read("README.md");
    let shipped = yaml("envoy/envoy.yaml");
    let blocks: Vec<&str> = readme
        .split("```yaml\n")
        .skip(1)
        .map(|rest| rest.split("```").next().expect("unterminated yaml block"))
        .collect();
    assert!(
        blocks.len() >= 3,
        "the README shows the filter, the route and the cluster: {} yaml blocks",
        blocks.len()
    );
    for block in blocks {
        let excerpt: Value = serde_yaml::from_str(block)
            .unwrap_or_else(|e| panic!("README excerpt is not YAML ({e}):\n{block}"));
        let empty = match &excerpt {
            Value::Mapping(map) => map.is_empty(),
            Value::Sequence(items) => items.is_empty(),
            _ => true,
        };
        assert!(!empty, "README excerpt shows nothing:\n{block}");
        assert!(
            contained_somewhere(&excerpt, &shipped),
            "this README excerpt is not part of envoy/envoy.yaml:\n{block}"
        );
    }
}
