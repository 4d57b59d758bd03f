//! The tokenizer and chat template of a checkpoint: `tokenizer.json` through
//! the `tokenizers` crate, `tokenizer_config.json` for special tokens and the
//! Jinja chat template (rendered with minijinja the way transformers renders
//! it: `trim_blocks`, `lstrip_blocks`, Python string methods), and
//! `generation_config.json` for extra end-of-sequence ids.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ModelError;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// The text.
    pub content: String,
}

/// A checkpoint's tokenizer with its chat template and special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    eos_token_ids: Vec<i64>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("eos_token_ids", &self.eos_token_ids)
            .finish()
    }
}

/// A special token in `tokenizer_config.json`: a string, or an object with `content`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, ModelError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelError::Json {
            path: path.display().to_string(),
            message: e.to_string(),
        })
}

impl Tokenizer {
    /// Loads the tokenizer files of the checkpoint folder `dir`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::io(&path, "missing"));
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::Json {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let chat_template = match config.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            // A list of named templates: take the one called `default`.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(String::from),
            _ => None,
        };
        let (bos_token, eos_token, pad_token) = (
            token_text(config.get("bos_token")),
            token_text(config.get("eos_token")),
            token_text(config.get("pad_token")),
        );
        let mut eos_token_ids: Vec<i64> = eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .map(i64::from)
            .into_iter()
            .collect();
        let gen_path = dir.join("generation_config.json");
        if let Some(gen) = read_json(&gen_path)? {
            let extra: Vec<i64> = match gen.get("eos_token_id") {
                Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
                Some(Value::Array(a)) => a.iter().filter_map(Value::as_i64).collect(),
                _ => Vec::new(),
            };
            for id in extra {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        Ok(Tokenizer {
            inner,
            dir: dir.to_path_buf(),
            chat_template,
            bos_token,
            eos_token,
            pad_token,
            eos_token_ids,
        })
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (BOS etc.).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>, ModelError> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| ModelError::Input(format!("tokenizing: {e}")))?;
        Ok(encoding.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// The token strings of `text`.
    pub fn tokens(&self, text: &str) -> Result<Vec<String>, ModelError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Input(format!("tokenizing: {e}")))?;
        Ok(encoding.get_tokens().to_vec())
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String, ModelError> {
        let ids: Vec<u32> = ids
            .iter()
            .map(|&i| {
                u32::try_from(i).map_err(|_| {
                    ModelError::Input(format!("token id {i} is negative or too large"))
                })
            })
            .collect::<Result<_, _>>()?;
        self.inner
            .decode(&ids, skip_special_tokens)
            .map_err(|e| ModelError::Input(format!("decoding: {e}")))
    }

    /// Renders `messages` with the chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            ModelError::config(
                &self.dir.join("tokenizer_config.json"),
                "chat_template",
                "missing: this tokenizer has no chat template",
            )
        })?;
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            pad_token => self.pad_token.clone().unwrap_or_default(),
        };
        env.render_str(template, ctx).map_err(|e| {
            ModelError::config(
                &self.dir.join("tokenizer_config.json"),
                "chat_template",
                format!("rendering failed: {e}"),
            )
        })
    }

    /// Token ids of the rendered chat (special tokens in the text are parsed, none added).
    pub fn encode_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<i64>, ModelError> {
        self.encode(
            &self.apply_chat_template(messages, add_generation_prompt)?,
            false,
        )
    }

    /// Every end-of-sequence id: the tokenizer's eos token and `generation_config.json`'s list.
    pub fn eos_token_ids(&self) -> &[i64] {
        &self.eos_token_ids
    }

    /// The padding token's id, if there is one.
    pub fn pad_token_id(&self) -> Option<i64> {
        self.pad_token
            .as_deref()
            .and_then(|t| self.inner.token_to_id(t))
            .map(i64::from)
    }

    /// The vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The folder it was loaded from (its files are copied when a model is saved).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}
