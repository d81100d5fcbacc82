//! Which API a request speaks, decided from its path alone (query excluded).

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
