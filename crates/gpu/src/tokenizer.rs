//! The tokenizer and chat template of a checkpoint: `tokenizer.json` through
//! the `tokenizers` crate, `tokenizer_config.json` for special tokens and the
//! Jinja chat template (rendered with minijinja the way transformers renders
//! it: `trim_blocks`, `lstrip_blocks`, Python string methods), and
//! `generation_config.json` for extra end-of-sequence ids.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ModelError;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// The text.
    pub content: String,
}

/// A checkpoint's tokenizer with its chat template and special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    chat_template: Option<String>,
    /// The chat template compiled, on first use (or why it does not compile).
    chat: std::sync::OnceLock<Result<std::sync::Arc<minijinja::Environment<'static>>, String>>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    eos_token_ids: Vec<i64>,
    sampling: SamplingDefaults,
}

/// The default sampling of a checkpoint, as `generation_config.json` sets
/// it for transformers' `generate()`; every field is absent when the file
/// or its key is.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    /// `do_sample` (transformers decodes greedily when it is false or absent).
    pub do_sample: Option<bool>,
    /// `temperature`.
    pub temperature: Option<f64>,
    /// `top_p`.
    pub top_p: Option<f64>,
    /// `top_k`.
    pub top_k: Option<usize>,
}

impl SamplingDefaults {
    /// The sampling keys of a `generation_config.json` value; a key of the
    /// wrong type is an error naming it.
    fn from_json(v: &Value, path: &Path) -> Result<Self, ModelError> {
        let bad = |key: &str, want: &str| ModelError::Json {
            path: path.display().to_string(),
            message: format!("key {key}: {} is not {want}", v[key]),
        };
        let number = |key: &str| match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x.as_f64().map(Some).ok_or_else(|| bad(key, "a number")),
        };
        Ok(SamplingDefaults {
            do_sample: match v.get("do_sample") {
                None | Some(Value::Null) => None,
                Some(x) => Some(
                    x.as_bool()
                        .ok_or_else(|| bad("do_sample", "true or false"))?,
                ),
            },
            temperature: number("temperature")?,
            top_p: number("top_p")?,
            top_k: match v.get("top_k") {
                None | Some(Value::Null) => None,
                Some(x) => Some(
                    x.as_u64()
                        .ok_or_else(|| bad("top_k", "a whole number ≥ 0"))?
                        as usize,
                ),
            },
        })
    }
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
    let text = weir_durable::read_text_capped(path, weir_durable::SIDE_FILE_BYTES)
        .map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelError::Json {
            path: path.display().to_string(),
            message: e.to_string(),
        })
}

/// The chat template of a checkpoint folder, in the layouts transformers
/// writes: `chat_template.jinja` (transformers ≥ 4.50, and 5), the
/// `chat_template` key of `tokenizer_config.json` (a string, or a list of
/// named templates whose `default` is taken), or `chat_template.json`
/// (`{"chat_template": …}`, processors).
fn chat_template(dir: &Path, config: &Value) -> Result<Option<String>, ModelError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return weir_durable::read_text_capped(&jinja, weir_durable::SIDE_FILE_BYTES)
            .map(Some)
            .map_err(|e| ModelError::io(&jinja, e));
    }
    let from_config = match config.get("chat_template") {
        Some(Value::String(t)) => Some(t.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(String::from),
        _ => None,
    };
    if from_config.is_some() {
        return Ok(from_config);
    }
    Ok(read_json(&dir.join("chat_template.json"))?.and_then(|v| {
        v.get("chat_template")
            .and_then(Value::as_str)
            .map(String::from)
    }))
}

/// The name of the chat template in its environment.
const CHAT: &str = "chat";

/// The most instructions one rendering of a chat template may run: far
/// above any real template over a long conversation (a few hundred a
/// message), far below a template that loops for ever (which then fails
/// with one line in well under a second).
pub const CHAT_FUEL: u64 = 5_000_000;

/// The most memory one rendering of a chat template may hold at once: far
/// above any real conversation's rendering (a prompt file's record is at
/// most 16 MiB), far below a machine's memory. Fuel does not bound bytes:
/// one instruction repeats a string 10⁸ times, a few more double it.
pub const CHAT_BYTES: usize = 256 << 20;

/// A minijinja environment with `template` compiled as [`CHAT`], the
/// helpers transformers gives chat templates, and the fuel limit.
fn chat_environment(template: &str) -> Result<minijinja::Environment<'static>, String> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(CHAT_FUEL));
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
    // transformers' helper for templates that date their system prompt.
    env.add_function(
        "strftime_now",
        |format: String| -> Result<String, minijinja::Error> {
            let items: Vec<_> = chrono::format::StrftimeItems::new(&format).collect();
            if items.contains(&chrono::format::Item::Error) {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!("strftime_now: {format:?} is not a strftime format"),
                ));
            }
            Ok(chrono::Local::now()
                .format_with_items(items.into_iter())
                .to_string())
        },
    );
    env.add_template_owned(CHAT, template.to_string())
        .map_err(|e| e.to_string())?;
    Ok(env)
}

/// How many parsed `tokenizer.json` files [`parsed`] keeps.
const PARSED_KEPT: usize = 4;

/// The tokenizer that the `tokenizer.json` text `text` describes. A run
/// loads its policy's tokenizer in several roles (prompts, generator,
/// evaluation, judge, the checks before it starts), and parsing a large
/// vocabulary's file is most of a load (hundreds of milliseconds for a
/// 150k-token BPE), so this process keeps the last [`PARSED_KEPT`] parsed,
/// by their whole text: a changed file is parsed again.
fn parsed(text: String) -> Result<tokenizers::Tokenizer, String> {
    use std::sync::{Mutex, PoisonError};
    static KEPT: Mutex<Vec<(String, tokenizers::Tokenizer)>> = Mutex::new(Vec::new());
    {
        let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = kept.iter().position(|(t, _)| *t == text) {
            // The most recently used last.
            let entry = kept.remove(i);
            let tokenizer = entry.1.clone();
            kept.push(entry);
            return Ok(tokenizer);
        }
    }
    let tokenizer = text
        .parse::<tokenizers::Tokenizer>()
        .map_err(|e| e.to_string())?;
    let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
    if !kept.iter().any(|(t, _)| *t == text) {
        if kept.len() == PARSED_KEPT {
            kept.remove(0);
        }
        kept.push((text, tokenizer.clone()));
    }
    Ok(tokenizer)
}

impl Tokenizer {
    /// Loads the tokenizer files of the checkpoint folder `dir`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            let slow = ["tokenizer.model", "vocab.json"]
                .iter()
                .find(|f| dir.join(f).is_file());
            return Err(ModelError::io(
                &path,
                match slow {
                    // A slow (sentencepiece or BPE-files) tokenizer only.
                    Some(f) => format!(
                        "missing: weir reads a fast tokenizer's tokenizer.json, and this folder \
                         has only {f}; write one with transformers: \
                         AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
                    ),
                    None => "missing".to_string(),
                },
            ));
        }
        let text = weir_durable::read_text_capped(&path, weir_durable::TOKENIZER_BYTES)
            .map_err(|e| ModelError::io(&path, e))?;
        let inner = parsed(text).map_err(|message| ModelError::Json {
            path: path.display().to_string(),
            message,
        })?;
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let chat_template = chat_template(dir, &config)?;
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
        let mut sampling = SamplingDefaults::default();
        let gen = read_json(&gen_path)?;
        if let Some(gen) = &gen {
            sampling = SamplingDefaults::from_json(gen, &gen_path)?;
        }
        // The stop ids: the tokenizer's eos token, and generation_config.json's
        // and config.json's `eos_token_id` (transformers' generate() reads the
        // latter when the folder has no generation config).
        let model_config = read_json(&dir.join("config.json"))?;
        for source in [&gen, &model_config].into_iter().flatten() {
            let extra: Vec<i64> = match source.get("eos_token_id") {
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
            chat: std::sync::OnceLock::new(),
            bos_token,
            eos_token,
            pad_token,
            eos_token_ids,
            sampling,
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
        self.render_chat(messages, None, add_generation_prompt)
    }

    /// Renders a conversation with the chat template, as transformers'
    /// `apply_chat_template(messages, tools=tools)` does: `messages` are any
    /// serialisable messages (JSON objects with the fields the template
    /// reads: `role`, `content`, `tool_calls`, `tool_call_id`, `name`, …)
    /// and `tools` the tools' JSON schemas, handed to the template as
    /// `tools` (absent: `none`).
    pub fn render_chat<M: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            ModelError::config(
                &self.dir.join("tokenizer_config.json"),
                "chat_template",
                "missing: this tokenizer has no chat template",
            )
        })?;
        let config_file = || self.dir.join("tokenizer_config.json");
        let env = self
            .chat
            .get_or_init(|| chat_environment(template).map(std::sync::Arc::new))
            .as_ref()
            .map_err(|e| {
                ModelError::config(
                    &config_file(),
                    "chat_template",
                    format!("does not compile: {e}"),
                )
            })?;
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            pad_token => self.pad_token.clone().unwrap_or_default(),
        };
        let env = std::sync::Arc::clone(env);
        let rendered = crate::memory_budget::within(CHAT_BYTES, move || {
            env.get_template(CHAT)
                .and_then(|template| template.render(ctx))
                .map_err(|e| (e.kind(), e.to_string()))
        });
        let why = match rendered {
            Ok(Ok(text)) => return Ok(text),
            Ok(Err((minijinja::ErrorKind::OutOfFuel, _))) => format!(
                "rendering took more than {CHAT_FUEL} steps: a template that loops without \
                 end, or over far too much?"
            ),
            Ok(Err((_, e))) => format!("rendering failed: {e}"),
            Err(over) => format!(
                "rendering {over} (more than a conversation's text could take): a template \
                 that builds a huge string?"
            ),
        };
        Err(ModelError::config(&config_file(), "chat_template", why))
    }

    /// Token ids of a conversation rendered by [`Tokenizer::render_chat`]
    /// (special tokens in the text are parsed, none added).
    pub fn encode_conversation<M: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<Vec<i64>, ModelError> {
        self.encode(
            &self.render_chat(messages, tools, add_generation_prompt)?,
            false,
        )
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

    /// The checkpoint's default sampling (`generation_config.json`).
    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        &self.sampling
    }

    /// The chat template's text, as the folder gives it (`None`: it has none).
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Every end-of-sequence id: the tokenizer's eos token and the
    /// `eos_token_id` of `generation_config.json` and `config.json`.
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

    /// An upper bound on the bytes of text one token stands for (four per
    /// character of the longest token, added tokens included): a text of
    /// more than `n` times this many bytes encodes to more than `n` tokens,
    /// which a length check can tell without encoding it.
    pub fn max_token_bytes(&self) -> usize {
        self.inner
            .get_vocab(true)
            .keys()
            .map(|token| token.chars().count())
            .max()
            .unwrap_or(1)
            .max(1)
            * 4
    }

    /// The vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The folder it was loaded from (its files are copied when a model is saved).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The first token id of this tokenizer (called `name`) that `other`
    /// (`other_name`) reads as another token or not at all, in words;
    /// `None` when `other` gives every id of this one the same token
    /// (vocabulary and added tokens alike; ids only `other` has do not
    /// count: a newer family's added tokens after an older one's). What a
    /// model scoring this tokenizer's ids needs of its own; how the two
    /// split text (merges, normalizer) and how their files are laid out do
    /// not matter to it.
    pub fn id_difference(&self, name: &str, other: &Tokenizer, other_name: &str) -> Option<String> {
        let by_id = |t: &Tokenizer| -> std::collections::BTreeMap<u32, String> {
            t.inner
                .get_vocab(true)
                .into_iter()
                .map(|(token, id)| (id, token))
                .collect()
        };
        let (ours, theirs) = (by_id(self), by_id(other));
        let (id, token) = ours
            .iter()
            .find(|(id, token)| theirs.get(id) != Some(token))?;
        Some(format!(
            "token id {id} is {token:?} in {name} and {} in {other_name}",
            theirs
                .get(id)
                .map_or("no token".to_string(), |t| format!("{t:?}"))
        ))
    }
}

/// The ChatML template (the arith task's and Qwen's format).
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// The special tokens of [`train_chatml_bpe`], ids 0..4 in this order.
pub const CHATML_SPECIALS: [&str; 4] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"];

/// Trains a byte-level BPE tokenizer (digits split one by one, ChatML
/// special tokens at ids 0–3, `<|im_end|>` as eos, `<pad>` as padding) on
/// `corpus` and writes `tokenizer.json`, `tokenizer_config.json` (with the
/// ChatML template) and `special_tokens_map.json` into `dir`, so that
/// [`Tokenizer::load`] and transformers load it. Returns the vocabulary size.
pub fn train_chatml_bpe(
    corpus: &[String],
    vocab_size: usize,
    dir: &Path,
) -> Result<usize, ModelError> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, PreTokenizerWrapper};

    let fail = |what: &str, e: tokenizers::Error| ModelError::Input(format!("{what}: {e}"));
    let specials: Vec<AddedToken> = CHATML_SPECIALS
        .iter()
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    let mut tokenizer = tokenizers::TokenizerBuilder::<
        ModelWrapper,
        tokenizers::NormalizerWrapper,
        PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default().into())
    .with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]))))
    .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())))
    .build()
    .map_err(|e| fail("building the tokenizer", e))?;
    let mut trainer: tokenizers::models::TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer
        .train(&mut trainer, corpus.iter())
        .map_err(|e| fail("training the tokenizer", e))?;
    tokenizer.add_special_tokens(&specials);
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let path = dir.join("tokenizer.json");
    let text = tokenizer
        .to_string(false)
        .map_err(|e| fail(&path.display().to_string(), e))?;
    crate::snapshot::write_atomically(&path, text.as_bytes())?;
    let added: serde_json::Map<String, Value> = CHATML_SPECIALS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                i.to_string(),
                serde_json::json!({"content": t, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true}),
            )
        })
        .collect();
    let config = serde_json::json!({
        "add_bos_token": false,
        "add_eos_token": false,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": null,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "model_max_length": 512,
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": null,
    });
    let map = serde_json::json!({
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
    });
    for (name, value) in [
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", map),
    ] {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(&value).map_err(|e| ModelError::Json {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        crate::snapshot::write_atomically(&path, text.as_bytes())?;
    }
    Ok(tokenizer.get_vocab_size(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture's tokenizer, its `tokenizer.json` rewritten by `edit`.
    fn edited(edit: impl FnOnce(&mut Value)) -> (tempfile::TempDir, Tokenizer) {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
        let dir = tempfile::tempdir().unwrap();
        let mut json: Value =
            serde_json::from_slice(&std::fs::read(fixture.join("tokenizer.json")).unwrap())
                .unwrap();
        edit(&mut json);
        let text = serde_json::to_string_pretty(&json).unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), text).unwrap();
        let tokenizer = Tokenizer::load(dir.path()).unwrap();
        (dir, tokenizer)
    }

    #[test]
    fn tokenizers_differ_only_where_an_id_names_another_token() {
        let (_a, original) = edited(|_| {});
        // Another layout and fields no id depends on: the same ids.
        let (_b, relaid) = edited(|t| {
            t["truncation"] = serde_json::json!({"max_length": 7, "strategy": "LongestFirst", "stride": 0, "direction": "Right"});
        });
        assert_eq!(original.id_difference("a", &relaid, "b"), None);
        // Two ids swapped: the lower named, with both readings.
        let (_c, swapped) = edited(|t| {
            for id in t["model"]["vocab"].as_object_mut().unwrap().values_mut() {
                match id.as_i64() {
                    Some(40) => *id = 41.into(),
                    Some(41) => *id = 40.into(),
                    _ => {}
                }
            }
        });
        let said = original.id_difference("a", &swapped, "b").unwrap();
        let token = |t: &Tokenizer, id: u32| format!("{:?}", t.inner.id_to_token(id).unwrap());
        assert!(
            said == format!(
                "token id 40 is {} in a and {} in b",
                token(&original, 40),
                token(&original, 41)
            ),
            "{said}"
        );
        // A token only one of them has: missing where the other reads it.
        let next = original.vocab_size() as u32;
        let (_d, added) = edited(|t| {
            t["added_tokens"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({
                    "id": next, "content": "<tool>", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true
                }));
        });
        assert_eq!(original.id_difference("a", &added, "b"), None);
        let said = added.id_difference("b", &original, "a").unwrap();
        assert_eq!(
            said,
            format!("token id {next} is \"<tool>\" in b and no token in a")
        );
    }

    #[test]
    fn a_tokenizer_loaded_again_is_the_same_and_a_rewritten_file_is_read_again() {
        let (dir, first) = edited(|_| {});
        let again = Tokenizer::load(dir.path()).unwrap();
        let text = "12+30=42, then 7*6";
        assert_eq!(
            first.encode(text, true).unwrap(),
            again.encode(text, true).unwrap()
        );
        // The same folder, its file rewritten with two ids swapped: the new reading.
        let path = dir.path().join("tokenizer.json");
        let mut json: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for id in json["model"]["vocab"].as_object_mut().unwrap().values_mut() {
            match id.as_i64() {
                Some(40) => *id = 41.into(),
                Some(41) => *id = 40.into(),
                _ => {}
            }
        }
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
        let rewritten = Tokenizer::load(dir.path()).unwrap();
        assert_eq!(
            rewritten.inner.id_to_token(40),
            first.inner.id_to_token(41),
            "the rewritten file was not read again"
        );
        assert_eq!(rewritten.inner.id_to_token(41), first.inner.id_to_token(40));
    }
}
