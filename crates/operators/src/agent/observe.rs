//! What an episode appends after a turn: the template's boundary after the
//! model's end-of-turn token, then the observation (tool results, an
//! environment's answer) up to the next turn's generation prompt, as
//! tokens rendered by the checkpoint's own chat template.
//!
//! Only what is appended is rendered and tokenized; the tokens already in
//! the episode (the prompt, every generated token as sampled, earlier
//! observations) are never decoded and encoded again, so a word split
//! into other tokens in another context cannot change them. The rule:
//!
//! - `before` = the conversation so far, ending with the model's turn (its
//!   text as the assistant message's content), rendered without a
//!   generation prompt; `after` = the same with the new messages, with the
//!   generation prompt. `after` must begin with `before` (a template that
//!   renders earlier turns differently once more follow, as one that
//!   strips the reasoning of earlier turns does, cannot extend an episode
//!   token by token: [`check_stable`] refuses it at start-up).
//! - The **boundary** is what `before` renders after the end-of-turn token
//!   the model sampled (ChatML's `\n` after `<|im_end|>`; nothing after
//!   Llama 3's `<|eot_id|>`); the model did not write it, so it is masked
//!   like an observation.
//! - The **observation** is `after` past `before`.

use serde_json::{json, Value};
use weir_gpu::tokenizer::Tokenizer;
use weir_gpu::ModelError;

/// The tokens an episode appends after a turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Appended {
    /// The template's tokens after the end-of-turn token the model sampled.
    pub boundary: Vec<i64>,
    /// The new messages and the next turn's generation prompt.
    pub observation: Vec<i64>,
}

/// Why an episode cannot be extended.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// Rendering or tokenizing failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The template does not extend what it rendered before.
    #[error("the chat template renders the conversation before the new messages differently once they follow ({0}): an episode cannot be extended token by token")]
    Unstable(String),
    /// The model's turn did not end with an end-of-turn token the template writes.
    #[error(
        "the chat template does not write the end-of-turn token {0:?} after an assistant turn"
    )]
    NoEndOfTurn(String),
    /// The template ignores the tools' schemas.
    #[error("the chat template does not render `tools`, so the model would never see them: use a checkpoint whose template does (as transformers' apply_chat_template(tools=…) renders them)")]
    NoTools,
}

/// The tokens to append after the model's turn `turn` (its text as
/// sampled, ending with the end-of-turn token `end_of_turn`), given the
/// conversation before it (`history`), the new messages (`new`, tool or
/// environment messages) and the tools' schemas.
pub fn appended(
    tokenizer: &Tokenizer,
    history: &[Value],
    turn: &str,
    end_of_turn: &str,
    new: &[Value],
    tools: Option<&[Value]>,
) -> Result<Appended, ObserveError> {
    let content = turn.strip_suffix(end_of_turn).unwrap_or(turn);
    let mut messages = history.to_vec();
    messages.push(json!({"role": "assistant", "content": content}));
    let before = tokenizer.render_chat(&messages, tools, false)?;
    messages.extend_from_slice(new);
    let after = tokenizer.render_chat(&messages, tools, true)?;
    let Some(observation) = after.strip_prefix(before.as_str()) else {
        return Err(ObserveError::Unstable(first_difference(&before, &after)));
    };
    // The turn's content appears in `before` right before its end-of-turn
    // token; what follows that token is the boundary.
    let turn_end = format!("{content}{end_of_turn}");
    let Some(at) = before.rfind(&turn_end) else {
        return Err(ObserveError::NoEndOfTurn(end_of_turn.to_string()));
    };
    let boundary = &before[at + turn_end.len()..];
    Ok(Appended {
        boundary: tokenizer.encode(boundary, false)?,
        observation: tokenizer.encode(observation, false)?,
    })
}

/// Where `after` stops extending `before`, for the error.
fn first_difference(before: &str, after: &str) -> String {
    let at = before
        .char_indices()
        .zip(after.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(before.len().min(after.len()));
    let quote = |text: &str| -> String { text[at..].chars().take(40).collect() };
    format!(
        "at byte {at}, {:?} becomes {:?}",
        quote(before),
        quote(after)
    )
}

/// Refuses a template that cannot extend an episode: renders a probe
/// episode (a user question, a turn that calls a tool, its result, a
/// final turn) and checks each turn's render extends the one before, and
/// that the model's turns end with `end_of_turn`.
pub fn check_stable(
    tokenizer: &Tokenizer,
    end_of_turn: &str,
    tools: Option<&[Value]>,
) -> Result<(), ObserveError> {
    let history = [json!({"role": "user", "content": "What is 12 * 34?"})];
    let call = "<think>\nI should use the calculator.\n</think>\n\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}\n</tool_call>";
    let result = [json!({"role": "tool", "name": "calculator", "content": "408"})];
    appended(
        tokenizer,
        &history,
        &format!("{call}{end_of_turn}"),
        end_of_turn,
        &result,
        tools,
    )?;
    let mut longer = history.to_vec();
    longer.push(json!({"role": "assistant", "content": call}));
    longer.extend_from_slice(&result);
    appended(
        tokenizer,
        &longer,
        &format!("<think>\nThe tool said 408.\n</think>\n\n12 * 34 = 408{end_of_turn}"),
        end_of_turn,
        &[json!({"role": "user", "content": "And 13 * 34?"})],
        tools,
    )?;
    Ok(())
}

/// Refuses a chat template that renders a conversation the same with
/// `tools` as without them: the model would never see the tools.
pub fn check_shows_tools(tokenizer: &Tokenizer, tools: &[Value]) -> Result<(), ObserveError> {
    let messages = [json!({"role": "user", "content": "What is 12 * 34?"})];
    let with = tokenizer.render_chat(&messages, Some(tools), true)?;
    let without = tokenizer.render_chat(&messages, None, true)?;
    if with == without {
        return Err(ObserveError::NoTools);
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::Path;

    /// A ChatML template that renders tool results as Qwen2.5 does: a run
    /// of tool messages in one user turn, each in `<tool_response>` tags.
    pub(crate) const CHATML_TOOLS: &str = r#"{%- if tools %}{{ "<|im_start|>system\nYou may call these tools:\n" }}{% for tool in tools %}{{ tool | tojson }}{{ "\n" }}{% endfor %}{{ "<|im_end|>\n" }}{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{ "<|im_start|>user" }}{% endif %}
{{- "\n<tool_response>\n" + message.content + "\n</tool_response>" }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{ "<|im_end|>\n" }}{% endif %}
{%- else %}{{ "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ "<|im_start|>assistant\n" }}{% endif %}"#;

    /// A Llama 3 template: headers, `<|eot_id|>` with nothing after it, tool
    /// results as `ipython` turns.
    const LLAMA3_TOOLS: &str = r#"{{- bos_token }}{%- for message in messages %}{%- if message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"#;

    /// A template that drops the reasoning of earlier assistant turns, as
    /// Qwen3's does.
    const STRIPS_THINKING: &str = r#"{%- for message in messages %}{%- if message.role == "assistant" and not loop.last %}<|im_start|>assistant
{{ message.content.split('</think>')[-1] | trim }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

    pub(crate) fn tokenizer_with(template: &str, dir: &Path) -> Tokenizer {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
        std::fs::copy(fixture.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        let config = json!({
            "chat_template": template,
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        Tokenizer::load(dir).unwrap()
    }

    fn text(tokenizer: &Tokenizer, ids: &[i64]) -> String {
        tokenizer.decode(ids, false).unwrap()
    }

    #[test]
    fn chatml_appends_the_newline_after_im_end_then_the_tool_turn() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = tokenizer_with(CHATML_TOOLS, dir.path());
        let tools = [json!({"type": "function", "function": {"name": "calculator"}})];
        let history = [json!({"role": "user", "content": "12*34?"})];
        let turn = "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}\n</tool_call><|im_end|>";
        let new = [
            json!({"role": "tool", "content": "408"}),
            json!({"role": "tool", "content": "ok"}),
        ];
        let got = appended(&tokenizer, &history, turn, "<|im_end|>", &new, Some(&tools)).unwrap();
        // The newline the template writes after <|im_end|> is kept (and masked).
        assert_eq!(got.boundary, tokenizer.encode("\n", false).unwrap());
        let expected = "<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(got.observation, tokenizer.encode(expected, false).unwrap());
        // The episode's tokens, pieced together, are the whole conversation's render.
        let mut messages = history.to_vec();
        messages.push(json!({"role": "assistant", "content": turn.trim_end_matches("<|im_end|>")}));
        messages.extend_from_slice(&new);
        let whole = tokenizer
            .render_chat(&messages, Some(&tools), true)
            .unwrap();
        let start = tokenizer.render_chat(&history, Some(&tools), true).unwrap();
        let pieced = format!(
            "{start}{turn}{}{}",
            text(&tokenizer, &got.boundary),
            text(&tokenizer, &got.observation)
        );
        assert_eq!(pieced, whole);
    }

    #[test]
    fn llama3_has_no_boundary_after_eot_and_renders_tool_results_as_ipython() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = tokenizer_with(LLAMA3_TOOLS, dir.path());
        let history = [json!({"role": "user", "content": "7*8?"})];
        let turn =
            "{\"name\": \"calculator\", \"parameters\": {\"expression\": \"7*8\"}}<|eot_id|>";
        let new = [json!({"role": "tool", "content": "56"})];
        let got = appended(&tokenizer, &history, turn, "<|eot_id|>", &new, None).unwrap();
        assert!(
            got.boundary.is_empty(),
            "{:?}",
            text(&tokenizer, &got.boundary)
        );
        let expected = "<|start_header_id|>ipython<|end_header_id|>\n\n56<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
        assert_eq!(text(&tokenizer, &got.observation), expected);
        assert_eq!(got.observation, tokenizer.encode(expected, false).unwrap());
    }

    #[test]
    fn a_template_that_strips_earlier_reasoning_is_refused_with_where_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = tokenizer_with(STRIPS_THINKING, dir.path());
        let err = check_stable(&tokenizer, "<|im_end|>", None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("renders the conversation before the new messages differently"),
            "{err}"
        );
        assert!(err.contains("I should use the calculator"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let tools = [json!({"type": "function", "function": {"name": "calculator"}})];
        let chatml = tokenizer_with(CHATML_TOOLS, dir.path());
        check_stable(&chatml, "<|im_end|>", Some(&tools)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        check_stable(
            &tokenizer_with(LLAMA3_TOOLS, dir.path()),
            "<|eot_id|>",
            None,
        )
        .unwrap();
        // A template that never writes the end-of-turn token the model stops on.
        let dir = tempfile::tempdir().unwrap();
        let err = check_stable(
            &tokenizer_with(CHATML_TOOLS, dir.path()),
            "<|eot_id|>",
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("does not write the end-of-turn token \"<|eot_id|>\""),
            "{err}"
        );
    }
}
