//! `weir logprobs`, `weir generate`, `weir score`: the model runtime from
//! the command line, JSONL in, Parquet out. A bad input line is reported
//! with its file and line number and nothing is written; the output file
//! appears only when complete.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use arrow::array::{
    ArrayRef, Float32Array, Float32Builder, Int64Builder, ListBuilder, RecordBatch, StringArray,
    UInt64Array,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use tch::{Kind, Tensor};
use weir_gpu::{generate_with_ids, Device, Message, Model, SamplingParams, Tokenizer};
use weir_graph::parquet_log::write_parquet_atomically;

/// Where the model runs and in which dtype.
#[derive(Clone, Debug, clap::Args)]
pub struct ModelArgs {
    /// A checkpoint folder in HuggingFace layout.
    #[arg(long)]
    pub model: PathBuf,
    /// Input JSONL file.
    #[arg(long)]
    pub input: PathBuf,
    /// Output Parquet file.
    #[arg(long)]
    pub output: PathBuf,
    /// Compute dtype: f32, bf16, f16 or f64.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Sequences per forward pass.
    #[arg(long = "batch-size", default_value_t = 16)]
    pub batch_size: usize,
}

/// Flags of `weir generate` beyond the model's.
#[derive(Clone, Debug, clap::Args)]
pub struct GenerateArgs {
    /// The model and its device.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokens to generate at most.
    #[arg(long = "max-new-tokens")]
    pub max_new_tokens: usize,
    /// Always take the most likely token.
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    pub greedy: bool,
    /// Sampling temperature (default: the checkpoint's generation_config.json, else 1).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass (default: generation_config.json's top_p, else none).
    #[arg(long = "top-p")]
    pub top_p: Option<f64>,
    /// Keep only the k most likely tokens (default: generation_config.json's top_k, else none).
    #[arg(long = "top-k")]
    pub top_k: Option<usize>,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Generate exactly --max-new-tokens tokens (no stop at eos), as benchmarks need.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
}

fn kind(text: &str) -> anyhow::Result<Kind> {
    Ok(match text {
        "f32" | "float32" => Kind::Float,
        "bf16" | "bfloat16" => Kind::BFloat16,
        "f16" | "float16" => Kind::Half,
        "f64" | "float64" => Kind::Double,
        other => bail!("--dtype `{other}` is not one of f32, bf16, f16, f64"),
    })
}

fn load(args: &ModelArgs) -> anyhow::Result<Model> {
    let device: Device = args.device.parse()?;
    weir_gpu::device::set_threads(1);
    Ok(Model::load(&args.model, device, kind(&args.dtype)?)?)
}

/// Parses every line of a JSONL file; errors name the file and line.
/// A line is read only up to a prompt record's bound
/// (`weir_operators::data::prompt_files::MAX_RECORD_BYTES`).
fn read_jsonl(path: &Path) -> anyhow::Result<Vec<(usize, Value)>> {
    use std::io::{BufRead, Read};
    use weir_operators::data::prompt_files::MAX_RECORD_BYTES;
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let mut out = Vec::new();
    let mut line = Vec::new();
    for number in 1.. {
        line.clear();
        let read = (&mut reader)
            .take(MAX_RECORD_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)
            .with_context(|| format!("reading {}", path.display()))?;
        if read == 0 {
            break;
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        } else if line.len() > MAX_RECORD_BYTES {
            bail!(
                "{}: line {number} is longer than {} MiB (the most one input line may hold)",
                path.display(),
                MAX_RECORD_BYTES >> 20
            );
        }
        let text = String::from_utf8_lossy(&line);
        if text.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: line {number}: not JSON", path.display()))?;
        out.push((number, value));
    }
    if out.is_empty() {
        bail!("{}: no input lines", path.display());
    }
    Ok(out)
}

fn line_error(path: &Path, line: usize, message: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{}: line {line}: {message}", path.display())
}

fn ids_of(value: &Value, key: &str, path: &Path, line: usize) -> anyhow::Result<Vec<i64>> {
    let list = value
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| line_error(path, line, format!("`{key}` must be a list of token ids")))?;
    let ids: Option<Vec<i64>> = list.iter().map(Value::as_i64).collect();
    match ids {
        Some(ids) if !ids.is_empty() => Ok(ids),
        Some(_) => Err(line_error(path, line, format!("`{key}` is empty"))),
        None => Err(line_error(
            path,
            line,
            format!("`{key}` holds a value that is not an integer"),
        )),
    }
}

fn check_vocab(ids: &[i64], model: &Model, path: &Path, line: usize) -> anyhow::Result<()> {
    if let Some(bad) = ids.iter().find(|&&i| i < 0 || i >= model.config.vocab_size) {
        return Err(line_error(
            path,
            line,
            format!(
                "token id {bad} is outside the vocabulary (0..{})",
                model.config.vocab_size
            ),
        ));
    }
    Ok(())
}

fn messages_of(value: &Value, path: &Path, line: usize) -> anyhow::Result<Vec<Message>> {
    serde_json::from_value(value["messages"].clone())
        .map_err(|e| line_error(path, line, format!("`messages`: {e}")))
}

/// Token ids of one input line: `input_ids`, `prompt` (+ `response`), or `messages`.
fn prompt_ids(
    value: &Value,
    tokenizer: Option<&Tokenizer>,
    generation: bool,
    path: &Path,
    line: usize,
) -> anyhow::Result<Vec<i64>> {
    if value.get("input_ids").is_some() {
        return ids_of(value, "input_ids", path, line);
    }
    let tok = || {
        tokenizer.ok_or_else(|| {
            line_error(
                path,
                line,
                "text input needs the checkpoint's tokenizer.json",
            )
        })
    };
    if let Some(prompt) = value.get("prompt") {
        let prompt = prompt
            .as_str()
            .ok_or_else(|| line_error(path, line, "`prompt` must be a string"))?;
        let response = match value.get("response") {
            Some(r) => r
                .as_str()
                .ok_or_else(|| line_error(path, line, "`response` must be a string"))?,
            None => "",
        };
        let ids = tok()?.encode(&format!("{prompt}{response}"), true)?;
        if ids.is_empty() {
            return Err(line_error(path, line, "the text encodes to no tokens"));
        }
        return Ok(ids);
    }
    if value.get("messages").is_some() {
        return Ok(tok()?.encode_chat(&messages_of(value, path, line)?, generation)?);
    }
    Err(line_error(
        path,
        line,
        "expected `input_ids`, `prompt` or `messages`",
    ))
}

fn progress(total: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(what.to_string());
    bar
}

/// Right-pads `rows` into ids and mask tensors.
fn pad_right(rows: &[&Vec<i64>], pad: i64) -> (Tensor, Tensor) {
    let width = rows.iter().map(|r| r.len()).max().unwrap_or(1);
    let mut ids = Vec::with_capacity(rows.len() * width);
    let mut mask = Vec::with_capacity(rows.len() * width);
    for r in rows {
        ids.extend(
            r.iter()
                .copied()
                .chain(std::iter::repeat_n(pad, width - r.len())),
        );
        mask.extend(
            std::iter::repeat_n(1i64, r.len()).chain(std::iter::repeat_n(0, width - r.len())),
        );
    }
    let shape = [rows.len() as i64, width as i64];
    (
        Tensor::from_slice(&ids).view(shape),
        Tensor::from_slice(&mask).view(shape),
    )
}

fn ids_column(rows: impl Iterator<Item = Vec<i64>>) -> ArrayRef {
    let mut b = ListBuilder::new(Int64Builder::new());
    for r in rows {
        b.values().append_slice(&r);
        b.append(true);
    }
    Arc::new(b.finish())
}

fn floats_column(rows: impl Iterator<Item = Vec<f32>>) -> ArrayRef {
    let mut b = ListBuilder::new(Float32Builder::new());
    for r in rows {
        b.values().append_slice(&r);
        b.append(true);
    }
    Arc::new(b.finish())
}

/// `weir logprobs`.
pub fn logprobs(args: &ModelArgs) -> anyhow::Result<()> {
    let lines = read_jsonl(&args.input)?;
    let model = load(args)?;
    let inputs: Vec<Vec<i64>> = lines
        .iter()
        .map(|(line, v)| {
            let ids = ids_of(v, "input_ids", &args.input, *line)?;
            check_vocab(&ids, &model, &args.input, *line)?;
            if ids.len() < 2 {
                return Err(line_error(
                    &args.input,
                    *line,
                    "`input_ids` needs at least 2 tokens",
                ));
            }
            Ok(ids)
        })
        .collect::<anyhow::Result<_>>()?;
    let bar = progress(inputs.len(), "logprobs");
    let mut out: Vec<Vec<f32>> = Vec::with_capacity(inputs.len());
    let _guard = tch::no_grad_guard();
    // A float32 model on an AVX2 CPU runs on weir's CPU kernels (each
    // sequence as a one-token prompt and the rest as its response).
    let kernels = model.runs_on_cpu_kernels();
    for chunk in inputs.chunks(args.batch_size.max(1)) {
        if kernels {
            let (firsts, rests): (Vec<Vec<i64>>, Vec<Vec<i64>>) = chunk
                .iter()
                .map(|ids| (ids[..1].to_vec(), ids[1..].to_vec()))
                .unzip();
            out.extend(weir_gpu::generate::response_logprobs_on_cpu_kernels(
                &model, &firsts, &rests, 1.0,
            )?);
            bar.inc(chunk.len() as u64);
            continue;
        }
        let rows: Vec<&Vec<i64>> = chunk.iter().collect();
        let (ids, mask) = pad_right(&rows, model.config.pad_token_id.unwrap_or(0).max(0));
        let lp = model
            .token_logprobs(&ids, Some(&mask), 1.0)?
            .to_kind(Kind::Float);
        for (i, r) in chunk.iter().enumerate() {
            let row: Vec<f32> =
                Vec::<f32>::try_from(lp.get(i as i64).narrow(0, 0, r.len() as i64 - 1))?;
            out.push(row);
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let batch = RecordBatch::try_from_iter([
        ("input_ids", ids_column(inputs.into_iter())),
        ("token_logprobs", floats_column(out.into_iter())),
    ])?;
    write_parquet_atomically(&args.output, &[batch])?;
    eprintln!("wrote {} rows to {}", lines.len(), args.output.display());
    Ok(())
}

/// The checkpoint's tokenizer, if it has a `tokenizer.json` (token-id
/// input needs none); a tokenizer that is there but does not load is an error.
fn tokenizer_of(model: &Path) -> anyhow::Result<Option<Tokenizer>> {
    if !model.join("tokenizer.json").is_file() {
        return Ok(None);
    }
    Ok(Some(Tokenizer::load(model)?))
}

/// Refuses a nucleus mass or a temperature that a run's config would
/// refuse (`weir_gpu::top_p_error`, `weir_gpu::temperature_error`); each
/// value comes with where it came from.
fn check_sampling_values(
    top_p: (&str, Option<f64>),
    temperature: (&str, Option<f64>),
) -> anyhow::Result<()> {
    if let (source, Some(p)) = top_p {
        if let Some(why) = weir_gpu::top_p_error(p) {
            anyhow::bail!("{source} = {p} {why}: it is a nucleus mass");
        }
    }
    if let (source, Some(t)) = temperature {
        if let Some(why) = weir_gpu::temperature_error(t) {
            anyhow::bail!("{source} = {t} {why} (--greedy takes the most likely token)");
        }
    }
    Ok(())
}

/// `weir generate`.
pub fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let m = &args.model;
    check_sampling_values(("--top-p", args.top_p), ("--temperature", args.temperature))?;
    let lines = read_jsonl(&m.input)?;
    let model = load(m)?;
    let tokenizer = tokenizer_of(&m.model)?;
    let prompts: Vec<Vec<i64>> = lines
        .iter()
        .map(|(line, v)| {
            let ids = prompt_ids(v, tokenizer.as_ref(), true, &m.input, *line)?;
            check_vocab(&ids, &model, &m.input, *line)?;
            Ok(ids)
        })
        .collect::<anyhow::Result<_>>()?;
    let mut eos = tokenizer
        .as_ref()
        .map(|t| t.eos_token_ids().to_vec())
        .unwrap_or_default();
    for id in &model.config.eos_token_ids {
        if !eos.contains(id) {
            eos.push(*id);
        }
    }
    // Unset flags take the checkpoint's defaults, as transformers' generate() does.
    let defaults = tokenizer
        .as_ref()
        .map(|t| t.sampling_defaults().clone())
        .unwrap_or_default();
    let flagged = args.temperature.is_some() || args.top_p.is_some() || args.top_k.is_some();
    let greedy = args.greedy || (!flagged && defaults.do_sample == Some(false));
    // The checkpoint's own values are checked only where they take effect:
    // an unset flag while sampling.
    let config_key = |key: &str| {
        format!(
            "{}: `{key}`",
            m.model.join("generation_config.json").display()
        )
    };
    let sampling_default =
        |flag: Option<f64>, default: Option<f64>| default.filter(|_| flag.is_none() && !greedy);
    check_sampling_values(
        (
            &config_key("top_p"),
            sampling_default(args.top_p, defaults.top_p),
        ),
        (
            &config_key("temperature"),
            sampling_default(args.temperature, defaults.temperature),
        ),
    )?;
    let params = SamplingParams {
        max_new_tokens: args.max_new_tokens,
        greedy,
        temperature: args.temperature.or(defaults.temperature).unwrap_or(1.0),
        top_k: args.top_k.or(defaults.top_k).filter(|k| *k > 0),
        top_p: args.top_p.or(defaults.top_p).filter(|p| *p < 1.0),
        n: args.n,
        seed: args.seed,
        eos_token_ids: eos,
        ignore_eos: args.ignore_eos,
        sum_pi_squared: false,
    };
    let bar = progress(prompts.len(), "generate");
    let (mut prompt_index, mut sample_index, mut tokens, mut logprobs, mut texts, mut reasons) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let started = std::time::Instant::now();
    let mut new_tokens = 0usize;
    for (c, chunk) in prompts.chunks(m.batch_size.max(1)).enumerate() {
        let first = c * m.batch_size.max(1);
        let ids: Vec<u64> = (first as u64..(first + chunk.len()) as u64).collect();
        for g in generate_with_ids(&model, chunk, &ids, &params)? {
            prompt_index.push((first + g.prompt) as u64);
            sample_index.push(g.sample as u64);
            texts.push(match &tokenizer {
                Some(t) => t.decode(&g.tokens, true)?,
                None => String::new(),
            });
            new_tokens += g.tokens.len();
            reasons.push(g.finish_reason.as_str().to_string());
            tokens.push(g.tokens);
            logprobs.push(g.logprobs);
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let batch = RecordBatch::try_from_iter([
        (
            "prompt_index",
            Arc::new(UInt64Array::from(prompt_index)) as ArrayRef,
        ),
        (
            "sample_index",
            Arc::new(UInt64Array::from(sample_index)) as ArrayRef,
        ),
        ("response_tokens", ids_column(tokens.into_iter())),
        ("response_logprobs", floats_column(logprobs.into_iter())),
        ("response", Arc::new(StringArray::from(texts)) as ArrayRef),
        (
            "finish_reason",
            Arc::new(StringArray::from(reasons)) as ArrayRef,
        ),
    ])?;
    write_parquet_atomically(&m.output, &[batch])?;
    eprintln!(
        "wrote {} completions to {}",
        lines.len() * args.n,
        m.output.display()
    );
    println!("tokens_per_s={:.1}", new_tokens as f64 / seconds.max(1e-9));
    Ok(())
}

/// `weir score`.
pub fn score(args: &ModelArgs) -> anyhow::Result<()> {
    let lines = read_jsonl(&args.input)?;
    let model = load(args)?;
    if model.config.head != weir_gpu::Head::SequenceClassification {
        bail!(
            "{}: `{}` is not a reward model (expected a *ForSequenceClassification checkpoint)",
            args.model.display(),
            model.config.architecture
        );
    }
    let tokenizer = tokenizer_of(&args.model)?;
    let inputs: Vec<Vec<i64>> = lines
        .iter()
        .map(|(line, v)| {
            let ids = prompt_ids(v, tokenizer.as_ref(), false, &args.input, *line)?;
            check_vocab(&ids, &model, &args.input, *line)?;
            Ok(ids)
        })
        .collect::<anyhow::Result<_>>()?;
    let bar = progress(inputs.len(), "score");
    let mut scores = Vec::with_capacity(inputs.len());
    let _guard = tch::no_grad_guard();
    for chunk in inputs.chunks(args.batch_size.max(1)) {
        let rows: Vec<&Vec<i64>> = chunk.iter().collect();
        let (ids, mask) = pad_right(&rows, model.config.pad_token_id.unwrap_or(0).max(0));
        let s = model.scores(&ids, Some(&mask))?.to_kind(Kind::Float);
        scores.extend(Vec::<f32>::try_from(s.select(1, 0))?);
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let batch = RecordBatch::try_from_iter([
        ("input_ids", ids_column(inputs.into_iter())),
        ("score", Arc::new(Float32Array::from(scores)) as ArrayRef),
    ])?;
    write_parquet_atomically(&args.output, &[batch])?;
    eprintln!("wrote {} scores to {}", lines.len(), args.output.display());
    Ok(())
}

/// `weir devices`.
pub fn devices() -> anyhow::Result<()> {
    println!(
        "cpu: {} threads available",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    match weir_gpu::cuda::list_devices() {
        Ok(devices) if devices.is_empty() => println!("cuda: driver present, no devices"),
        Ok(devices) => {
            for d in devices {
                println!(
                    "cuda:{} {} free {:.1} GiB of {:.1} GiB",
                    d.index,
                    d.name,
                    d.free_bytes as f64 / 1073741824.0,
                    d.total_bytes as f64 / 1073741824.0
                );
            }
        }
        Err(err) => println!("cuda: {err}"),
    }
    println!("libtorch sees {} CUDA device(s)", Device::cuda_count());
    Ok(())
}

/// Flags of `weir merge`.
#[derive(Clone, Debug, clap::Args)]
pub struct MergeArgs {
    /// A PEFT LoRA adapter folder (a LoRA run's checkpoint `actor/`).
    pub adapter: PathBuf,
    /// The folder to write the merged HuggingFace checkpoint to (must not exist, or be empty).
    #[arg(long)]
    pub output: PathBuf,
    /// The base checkpoint (default: the adapter's `base_model_name_or_path`).
    #[arg(long)]
    pub base: Option<PathBuf>,
    /// The merged weights' dtype: f32, bf16, f16 or f64.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

/// `weir merge`: folds a LoRA adapter into its base model's weights
/// (`W + alpha/r · B·A`, computed in float64) and saves a plain checkpoint.
pub fn merge(args: &MergeArgs) -> anyhow::Result<()> {
    use weir_gpu::lora::{LoraConfig, ADAPTER_CONFIG};
    let save_kind = kind(&args.dtype)?;
    if !args.adapter.join(ADAPTER_CONFIG).is_file() {
        bail!(
            "{}: no {ADAPTER_CONFIG}: not a PEFT adapter folder",
            args.adapter.display()
        );
    }
    let occupied = std::fs::read_dir(&args.output).is_ok_and(|mut d| d.next().is_some());
    if occupied {
        bail!(
            "--output {}: the folder exists and is not empty",
            args.output.display()
        );
    }
    let (config, recorded_base) = LoraConfig::read_peft(&args.adapter)?;
    let base = args.base.clone().unwrap_or(recorded_base);
    weir_gpu::device::set_threads(1);
    let mut model = Model::load(&base, Device::Cpu, Kind::Double)
        .with_context(|| format!("the base model of {}", args.adapter.display()))?;
    model.add_lora(&config, 0)?;
    model.load_adapter_weights(&args.adapter)?;
    model.merge_lora()?;
    model.save(&args.output, Some(save_kind))?;
    eprintln!(
        "merged {} (rank {}, alpha {}) into {}: wrote {}",
        args.adapter.display(),
        config.rank,
        config.alpha,
        base.display(),
        args.output.display()
    );
    Ok(())
}
