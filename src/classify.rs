//! Which API a request speaks, decided from its path alone (query excluded),
//! and the path rules that say so (the configuration holds a list of them).

/// The API a request speaks, which decides how its routing prefix is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiKind {
    /// Native invoke: the prefix is the body's first bytes.
    Invoke,
    /// OpenAI `/chat/completions`: text of `messages`.
    ChatCompletions,
    /// OpenAI `/completions`: text of `prompt`.
    Completions,
    /// OpenAI `/responses`: `instructions` then `input`.
    Responses,
}

/// One path rule: a path ending in `suffix` speaks `api`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathRule {
    pub suffix: String,
    pub api: ApiKind,
}

/// `/chat/completions` first: `/completions` is its suffix too.
pub fn default_path_rules() -> Vec<PathRule> {
    [
        ("/chat/completions", ApiKind::ChatCompletions),
        ("/completions", ApiKind::Completions),
        ("/responses", ApiKind::Responses),
    ]
    .into_iter()
    .map(|(suffix, api)| PathRule {
        suffix: suffix.to_string(),
        api,
    })
    .collect()
}

/// The API a request at `path` speaks: the first rule whose suffix ends the
/// path (query and fragment excluded) wins; no match means native invoke.
/// Matching is byte-exact and case-sensitive, as paths are; a trailing `/`
/// after the suffix does not match.
pub fn classify(path: &[u8], rules: &[PathRule]) -> ApiKind {
    let end = path
        .iter()
        .position(|&b| b == b'?' || b == b'#')
        .unwrap_or(path.len());
    let path = path.get(..end).unwrap_or(path);
    rules
        .iter()
        .find(|rule| path.ends_with(rule.suffix.as_bytes()))
        .map_or(ApiKind::Invoke, |rule| rule.api)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(path: &str) -> ApiKind {
        classify(path.as_bytes(), &default_path_rules())
    }

    #[test]
    fn openai_suffixes_after_any_prefix() {
        assert_eq!(kind("/v1/chat/completions"), ApiKind::ChatCompletions);
        assert_eq!(
            kind("/endpoints/my-ep/openai/v1/chat/completions"),
            ApiKind::ChatCompletions
        );
        assert_eq!(kind("/chat/completions"), ApiKind::ChatCompletions);
        assert_eq!(kind("/v1/completions"), ApiKind::Completions);
        assert_eq!(kind("/v1/responses"), ApiKind::Responses);
    }

    #[test]
    fn query_and_fragment_are_excluded() {
        assert_eq!(
            kind("/v1/chat/completions?stream=true"),
            ApiKind::ChatCompletions
        );
        assert_eq!(kind("/v1/completions#x"), ApiKind::Completions);
        // The suffix in the query does not count.
        assert_eq!(kind("/invocations?next=/v1/completions"), ApiKind::Invoke);
    }

    #[test]
    fn everything_else_is_invoke() {
        for path in [
            "/invocations",
            "/",
            "",
            "?",
            "/v1/chat/completions/",
            "/v1/Chat/Completions",
            "/v1/xcompletions",
            "/v1/responses/abc",
        ] {
            assert_eq!(kind(path), ApiKind::Invoke, "{path}");
        }
        assert_eq!(
            classify(b"/\xff\xfe", &default_path_rules()),
            ApiKind::Invoke
        );
    }

    #[test]
    fn first_matching_rule_wins() {
        let rules = vec![
            PathRule {
                suffix: "/completions".into(),
                api: ApiKind::Completions,
            },
            PathRule {
                suffix: "/chat/completions".into(),
                api: ApiKind::ChatCompletions,
            },
            PathRule {
                suffix: "/generate".into(),
                api: ApiKind::Responses,
            },
        ];
        assert_eq!(
            classify(b"/v1/chat/completions", &rules),
            ApiKind::Completions
        );
        assert_eq!(classify(b"/x/generate", &rules), ApiKind::Responses);
        assert_eq!(classify(b"/v1/chat/completions", &[]), ApiKind::Invoke);
    }
}
