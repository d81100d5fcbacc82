//! The checked-in JSON Schema of the plugin configuration is the one the
//! filter's configuration types give, and the documentation names exactly
//! the fields it has.

use std::collections::BTreeSet;

use prefix_router_tools::envoy::workspace_root;
use prefix_router_tools::schema::{self, SCHEMA_FILE};
use serde_json::Value;

fn read(file: &str) -> String {
    std::fs::read_to_string(workspace_root().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn schema() -> Value {
    serde_json::from_str(&schema::generate()).expect("the schema is JSON")
}

fn names(properties: &Value) -> BTreeSet<String> {
    properties
        .as_object()
        .expect("an object of properties")
        .keys()
        .cloned()
        .collect()
}

/// The fields the first table under `heading` lists in its first column
/// (a cell may name several: `` `running_metric`, `waiting_metric` ``).
fn documented(doc: &str, heading: &str) -> BTreeSet<String> {
    let section = doc
        .split(heading)
        .nth(1)
        .unwrap_or_else(|| panic!("docs/configuration.md has no {heading:?}"));
    section
        .lines()
        .skip_while(|line| !line.starts_with("| Field |"))
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .flat_map(|row| {
            let cell = row.split(" | ").next().unwrap_or_default();
            cell.trim_start_matches("| ")
                .split(", ")
                .map(|name| name.trim_matches('`').to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_checked_in_schema_is_the_generated_one() {
    assert!(
        read(SCHEMA_FILE) == schema::generate(),
        "{SCHEMA_FILE} is stale: run `cargo xtask schema` and commit it"
    );
}

#[test]
fn every_field_of_the_schema_is_documented_and_every_documented_field_exists() {
    let schema = schema();
    let doc = read("docs/configuration.md");
    let top = &schema["properties"];
    // Two tiers: what most deployments set, then every other field.
    let mut both = documented(&doc, "\n## What most deployments set\n");
    let advanced = documented(&doc, "\n## Advanced\n");
    assert!(both.is_disjoint(&advanced), "a field in both tiers");
    both.extend(advanced);
    assert_eq!(both, names(top));
    for (field, heading) in [
        ("engine_load", "\n## Engine load (`engine_load`)\n"),
        (
            "discovery",
            "\n## The fleet from Envoy's admin (`discovery`)\n",
        ),
    ] {
        let reference = top[field]["anyOf"][0]["$ref"]
            .as_str()
            .and_then(|r| r.strip_prefix("#/definitions/"))
            .unwrap_or_else(|| panic!("{field} refers to its definition"));
        let properties = &schema["definitions"][reference]["properties"];
        assert_eq!(documented(&doc, heading), names(properties), "{field}");
    }
    let rule_ref = top["path_rules"]["items"]["$ref"]
        .as_str()
        .and_then(|r| r.strip_prefix("#/definitions/"))
        .expect("path_rules refers to its items' definition");
    let path_rules_row = doc
        .lines()
        .find(|line| line.starts_with("| `path_rules` |"))
        .expect("path_rules is documented");
    for field in names(&schema["definitions"][rule_ref]["properties"]) {
        assert!(
            path_rules_row.contains(&format!("\"{field}\"")),
            "the path_rules row does not name {field}: {path_rules_row}"
        );
    }
}

#[test]
fn the_readme_complete_example_sets_every_field() {
    let readme = read("README.md");
    let json = readme
        .split("A complete example")
        .nth(1)
        .and_then(|after| after.split("```json").nth(1))
        .and_then(|block| block.split("```").next())
        .expect("the README has its complete example");
    let example: Value = serde_json::from_str(json).expect("the example is JSON");
    assert_eq!(names(&example), names(&schema()["properties"]));
}
