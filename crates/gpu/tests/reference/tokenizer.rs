//! The tokenizer and chat template; arith-sft greedy completions on all 500 pairs.

use super::*;

#[test]
fn tokenizer_and_chat_template_match_transformers() {
    use weir_gpu::{Message, Tokenizer};
    let dir = fixtures().join("tokenizer");
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tokenizer_reference.json")).unwrap(),
    )
    .unwrap();
    let tok = Tokenizer::load(&dir).unwrap();
    for case in r["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids, ints(&case["ids"]), "ids of {text:?}");
        let tokens: Vec<String> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect();
        assert_eq!(tok.tokens(text).unwrap(), tokens, "tokens of {text:?}");
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "decoded {text:?}"
        );
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap(),
            "decoded (skip special) {text:?}"
        );
    }
    for case in r["chat"].as_array().unwrap() {
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            tok.apply_chat_template(&messages, add).unwrap(),
            case["rendered"].as_str().unwrap()
        );
        assert_eq!(tok.encode_chat(&messages, add).unwrap(), ints(&case["ids"]));
    }
    assert_eq!(tok.eos_token_ids(), &[r["eos_token_id"].as_i64().unwrap()]);
    assert_eq!(tok.pad_token_id(), r["pad_token_id"].as_i64());
    // qwen2's generation config lists two eos ids; both count.
    let qwen = Tokenizer::load(&fixtures().join("models/tiny-qwen2")).unwrap();
    assert_eq!(qwen.eos_token_ids(), &[2, 0]);
    // …and its default sampling, which `weir generate` starts from.
    let d = qwen.sampling_defaults();
    assert_eq!(
        (d.do_sample, d.temperature, d.top_p, d.top_k),
        (Some(true), Some(0.7), Some(0.8), Some(20))
    );
    assert_eq!(tok.sampling_defaults().do_sample, None);
}

#[test]
fn arith_sft_greedy_completions_match_transformers_on_all_500_pairs() {
    use weir_gpu::{generate, Message, SamplingParams, Tokenizer};
    let dir = fixtures().join("models/arith-sft");
    let r = reference("arith-sft");
    let tok = Tokenizer::load(&dir).unwrap();
    let model = load("arith-sft", Kind::Float);
    let pairs: Vec<Vec<i64>> = r["eval_pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    let prompts: Vec<Vec<i64>> = pairs
        .iter()
        .map(|p| {
            tok.encode_chat(
                &[Message {
                    role: "user".into(),
                    content: format!("Compute: {}+{}", p[0], p[1]),
                }],
                true,
            )
            .unwrap()
        })
        .collect();
    let params = SamplingParams {
        max_new_tokens: 6,
        greedy: true,
        eos_token_ids: tok.eos_token_ids().to_vec(),
        ..Default::default()
    };
    let out = generate(&model, &prompts, &params).unwrap();
    let expected: Vec<Vec<i64>> = r["greedy_completion_ids_fp32"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    let mismatches: Vec<usize> = (0..pairs.len())
        .filter(|&i| out[i].tokens != expected[i])
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} of 500 completions differ, first at pair {:?}",
        mismatches.len(),
        mismatches.first().map(|&i| &pairs[i])
    );
    let correct = out
        .iter()
        .zip(&pairs)
        .filter(|(g, p)| tok.decode(&g.tokens, true).unwrap().trim() == (p[0] + p[1]).to_string())
        .count();
    let accuracy = correct as f64 / pairs.len() as f64;
    assert!(
        (accuracy - r["greedy_accuracy_fp32"].as_f64().unwrap()).abs() < 1e-9,
        "accuracy {accuracy}"
    );
}

#[test]
fn a_trained_chatml_bpe_round_trips_and_renders_chat() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus: Vec<String> = (0..400)
        .map(|i| {
            format!(
                "<|im_start|>user\nCompute: {}+{}<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n",
                i % 97,
                i % 89,
                i % 97 + i % 89
            )
        })
        .collect();
    let vocab = weir_gpu::tokenizer::train_chatml_bpe(&corpus, 300, tmp.path()).unwrap();
    assert!(vocab > 256 && vocab <= 300, "{vocab}");
    let tok = weir_gpu::Tokenizer::load(tmp.path()).unwrap();
    assert_eq!(tok.eos_token_ids(), &[2]);
    assert_eq!(tok.pad_token_id(), Some(3));
    let text = "Compute: 12+345 and more";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    // Digits are single tokens.
    let digits = tok.tokens("12345").unwrap();
    assert_eq!(digits.len(), 5, "{digits:?}");
    let messages = [weir_gpu::Message {
        role: "user".into(),
        content: "Compute: 1+2".into(),
    }];
    let rendered = tok.apply_chat_template(&messages, true).unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>user\nCompute: 1+2<|im_end|>\n<|im_start|>assistant\n"
    );
    let chat = tok.encode_chat(&messages, true).unwrap();
    assert_eq!(chat[0], 1, "<|im_start|> is one special token");
}

/// Templates that date their system prompt (Llama 3.1, Mistral) call
/// transformers' `strftime_now`; a bad format is an error naming it.
#[test]
fn chat_templates_may_date_their_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("tokenizer");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    let template =
        "{%- if strftime_now is defined %}{%- set d = strftime_now(\"%Y-%m-%d|%d %b %Y\") %}\
                    {%- else %}{%- set d = \"none\" %}{%- endif %}\
                    Today: {{ d }}\n{% for m in messages %}{{ m.content }}{% endfor %}";
    std::fs::write(tmp.path().join("chat_template.jinja"), template).unwrap();
    let tok = weir_gpu::Tokenizer::load(tmp.path()).unwrap();
    let messages = [weir_gpu::Message {
        role: "user".into(),
        content: "hi".into(),
    }];
    let rendered = tok.apply_chat_template(&messages, true).unwrap();
    let date = rendered
        .strip_prefix("Today: ")
        .and_then(|r| r.strip_suffix("\nhi"))
        .unwrap_or_else(|| panic!("{rendered:?}"));
    let (iso, long) = date.split_once('|').unwrap();
    assert_eq!(iso.len(), 10, "{iso}");
    assert!(iso.starts_with("20") && iso.as_bytes()[4] == b'-', "{iso}");
    assert_eq!(&long[long.len() - 4..], &iso[..4], "{long}");
    std::fs::write(
        tmp.path().join("chat_template.jinja"),
        "{{ strftime_now(\"%Q\") }}",
    )
    .unwrap();
    let tok = weir_gpu::Tokenizer::load(tmp.path()).unwrap();
    let err = tok
        .apply_chat_template(&messages, true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template") && err.contains("\"%Q\" is not a strftime format"),
        "{err}"
    );
}

/// A checkpoint's chat template that would loop for ever (nested ranges)
/// fails with one line naming the template once it has spent its fuel; one
/// that does not compile says so; a real one over a long chat renders.
#[test]
fn a_template_that_loops_for_ever_or_does_not_compile_is_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("tokenizer");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    let messages: Vec<weir_gpu::Message> = (0..2000)
        .map(|i| weir_gpu::Message {
            role: if i % 2 == 0 { "user" } else { "assistant" }.into(),
            content: format!("message {i}"),
        })
        .collect();
    let real = weir_gpu::Tokenizer::load(tmp.path()).unwrap();
    let rendered = real.apply_chat_template(&messages, true).unwrap();
    assert!(rendered.contains("message 1999"));

    let looping = "{% for i in range(100000) %}{% for j in range(100000) %}\
                   {% for k in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}";
    std::fs::write(tmp.path().join("chat_template.jinja"), looping).unwrap();
    let tok = weir_gpu::Tokenizer::load(tmp.path()).unwrap();
    let err = tok
        .apply_chat_template(&messages[..1], true)
        .unwrap_err()
        .to_string();
    // Stopped by the fuel bound (10¹⁵ iterations never end otherwise).
    let spent = format!("more than {} steps", weir_gpu::tokenizer::CHAT_FUEL);
    assert!(
        err.contains("chat_template")
            && err.contains(&spent)
            && err.contains("loops without end")
            && !err.contains('\n'),
        "{err}"
    );

    std::fs::write(
        tmp.path().join("chat_template.jinja"),
        "{% for m in messages %}",
    )
    .unwrap();
    let tok = weir_gpu::Tokenizer::load(tmp.path()).unwrap();
    let err = tok
        .apply_chat_template(&messages[..1], true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template") && err.contains("does not compile"),
        "{err}"
    );
}

/// Chat templates that build huge values in a few instructions (fuel does
/// not bound bytes) fail with one line naming the template and the memory
/// bound, the process's memory staying within a small multiple of it.
#[test]
fn a_template_that_builds_a_huge_string_is_one_line_within_its_memory_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("tokenizer");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    let message = [weir_gpu::Message {
        role: "user".into(),
        content: "hi".into(),
    }];
    let bombs = [
        // The largest repeat minijinja allows, concatenated.
        "{% set s = 'x' * 100000000 %}{{ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s }}",
        // A string doubled in a loop: 2⁴⁰ bytes in 80 instructions.
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}\
         {% endfor %}{{ ns.s|length }}",
        // The same through `+` and a filter.
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}\
         {% set ns.s = (ns.s + ns.s)|replace('a', 'aa') %}{% endfor %}{{ ns.s }}",
        // A list doubled, then joined.
        "{% set ns = namespace(l=['xxxxxxxx']) %}{% for i in range(40) %}\
         {% set ns.l = (ns.l + ns.l)|list %}{% endfor %}{{ ns.l|join(',') }}",
    ];
    for bomb in bombs {
        std::fs::write(tmp.path().join("chat_template.jinja"), bomb).unwrap();
        let tok = weir_gpu::Tokenizer::load(tmp.path()).unwrap();
        let err = tok
            .apply_chat_template(&message, true)
            .unwrap_err()
            .to_string();
        let bound = format!(
            "needs more than {} MiB",
            weir_gpu::tokenizer::CHAT_BYTES >> 20
        );
        assert!(
            err.contains("chat_template") && err.contains(&bound) && !err.contains('\n'),
            "{bomb}: {err}"
        );
    }
    // Each stopped rendering holds at most its bound; nothing grew past it.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(peak_kib < 3 << 20, "peak RSS {peak_kib} KiB");
}

/// A folder with only a slow tokenizer says how to write the fast one.
#[test]
fn a_slow_tokenizer_alone_is_named_with_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let err = weir_gpu::Tokenizer::load(tmp.path())
        .unwrap_err()
        .to_string();
    assert!(err.ends_with("tokenizer.json: missing"), "{err}");
    std::fs::write(tmp.path().join("tokenizer.model"), b"sp").unwrap();
    let err = weir_gpu::Tokenizer::load(tmp.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer.json")
            && err.contains("only tokenizer.model")
            && err.contains("save_pretrained"),
        "{err}"
    );
}
