//! Generative judges through whole runs, with a scripted judge: the
//! arith checkpoint rewired to echo its last input token
//! ([`echo_judge`]), and templates that script the verdict the judge then
//! repeats.

use std::collections::BTreeMap;
use std::path::Path;

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::Float32Type;
use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rewards::rules;
use weir::operators::rollout::col;
use weir::pipelines::config::{JudgeVerdict, OnUnparsed, RewardKind, RewardTerm};
use weir::pipelines::PipelineKind;

use super::support::{chat_questions, config, echo_judge, run};

/// Each logged row: (step, completion, label, reward, judge's answer).
fn judged_rows(dir: &Path) -> Vec<(u64, String, String, f64, String)> {
    let mut out = Vec::new();
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        let text = |b: &RecordBatch, name: &str| -> Vec<String> {
            let c = b.column_by_name(name).unwrap().as_string::<i32>();
            (0..b.num_rows()).map(|i| c.value(i).to_string()).collect()
        };
        let steps = b
            .column_by_name(col::STEP)
            .unwrap()
            .as_primitive::<arrow::datatypes::UInt64Type>();
        let rewards = b
            .column_by_name(col::REWARD)
            .unwrap()
            .as_primitive::<Float32Type>();
        let (responses, labels, judged) = (
            text(&b, col::RESPONSE),
            text(&b, "answer"),
            text(&b, col::JUDGE_RESPONSE),
        );
        for i in 0..b.num_rows() {
            out.push((
                steps.value(i),
                rules::completion(&responses[i]).to_string(),
                labels[i].clone(),
                f64::from(rewards.value(i)),
                judged[i].clone(),
            ));
        }
    }
    out
}

/// A template that scripts the verdict: 1 when the completion is the label.
const SCRIPTED: &str = "{% if response == label %}1{% else %}0{% endif %}";

/// The regex verdict: the echo judge repeats the scripted digit, the
/// pattern reads it, so the judge's reward is the exact-match rule's, row
/// for row, and a run trained on it follows the rule's run step for step
/// (the judge's reward drives the same learning). As a weighted term its
/// verdict is scaled and logged the same.
#[test]
fn a_judge_reward_scores_as_its_verdict_rule_reads_the_judges_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let judge = echo_judge(tmp.path());
    let kind = PipelineKind::Grpo;
    let base = || {
        let mut cfg = config(kind, 3);
        cfg.generate.temperature = 1.5;
        cfg
    };
    let mut rule = base();
    rule.reward.rule = "exact".into();
    let rule_dir = tmp.path().join("rule");
    run(kind, rule, &rule_dir, false);

    let mut cfg = base();
    cfg.reward.kind = RewardKind::Judge;
    cfg.judge.path = judge.clone();
    cfg.judge.template = SCRIPTED.into();
    cfg.judge.chat = false;
    cfg.judge.pattern = r"(\d)".into();
    cfg.judge.max_new_tokens = 3;
    let dir = tmp.path().join("judge");
    run(kind, cfg.clone(), &dir, false);
    let rows = judged_rows(&dir);
    assert_eq!(rows.len(), 3 * 3 * 4);
    let (mut right, mut wrong) = (0, 0);
    for (_, completion, label, reward, answer) in &rows {
        let want = f64::from(u8::from(completion == label));
        assert_eq!(
            *reward, want,
            "{completion:?} vs {label:?}: judged {answer:?}"
        );
        assert!(answer.starts_with(&format!("{want}")), "{answer:?}");
        if want > 0.0 {
            right += 1
        } else {
            wrong += 1
        }
    }
    assert!(right > 0 && wrong > 0, "{right} right, {wrong} wrong");
    for name in ["loss", "reward"] {
        let metric = |d: &Path| -> BTreeMap<u64, f64> { super::support::metric(d, "learn", name) };
        assert_eq!(
            metric(&dir),
            metric(&rule_dir),
            "learn {name}: judge vs rule"
        );
    }
    assert_eq!(
        super::support::metric(&dir, "reward", "judge_unparsed").len(),
        3
    );

    // The judge on a worker of its own: the reward stages run there alone,
    // and the run is the colocated judge's row for row and step for step.
    let mut apart = cfg.clone();
    apart.placement.workers = 3;
    apart.placement.judge = vec![2];
    let apart_dir = tmp.path().join("apart");
    run(kind, apart, &apart_dir, false);
    let sorted = |mut rows: Vec<(u64, String, String, f64, String)>| {
        rows.sort_by(|a, b| a.partial_cmp(b).unwrap());
        rows
    };
    assert_eq!(sorted(judged_rows(&apart_dir)), sorted(rows.clone()));
    assert_eq!(
        super::support::metric(&apart_dir, "learn", "loss"),
        super::support::metric(&dir, "learn", "loss")
    );
    let workers = |d: &Path, stage: &str| -> std::collections::BTreeSet<u32> {
        super::support::metric_rows(d)
            .into_iter()
            .filter(|r| r.stage == stage)
            .map(|r| r.worker)
            .collect()
    };
    assert_eq!(workers(&apart_dir, "reward"), [2].into());
    assert_eq!(workers(&dir, "reward"), [0].into());
    assert!(!workers(&apart_dir, "generate").contains(&2));

    // The judge as a term of weight 2: its verdict doubled, its answers logged.
    let mut terms = cfg.clone();
    terms.reward.kind = RewardKind::Terms;
    terms.reward.terms = vec![RewardTerm {
        rule: Some("judge".into()),
        weight: 2.0,
        ..Default::default()
    }];
    let terms_dir = tmp.path().join("terms");
    run(kind, terms, &terms_dir, false);
    let first = |rows: &[(u64, String, String, f64, String)]| -> Vec<(String, f64)> {
        rows.iter()
            .filter(|r| r.0 == 0)
            .map(|r| (r.1.clone(), r.3))
            .collect()
    };
    let doubled: Vec<(String, f64)> = first(&rows)
        .into_iter()
        .map(|(c, r)| (c, 2.0 * r))
        .collect();
    assert_eq!(first(&judged_rows(&terms_dir)), doubled);

    // An answer with no number: an error naming the row and the answer,
    // or the configured reward.
    let mut unparsed = cfg.clone();
    unparsed.judge.template = "x".into();
    let err = super::support::run_err(kind, unparsed.clone(), &tmp.path().join("unparsed"));
    assert!(err.contains("row 0") && err.contains("xxx"), "{err}");
    unparsed.judge.on_unparsed = OnUnparsed::Reward;
    unparsed.judge.unparsed_reward = -0.5;
    let dir = tmp.path().join("unparsed-reward");
    run(kind, unparsed, &dir, false);
    assert!(judged_rows(&dir).iter().all(|r| r.3 == -0.5));
    assert!(super::support::metric(&dir, "reward", "judge_unparsed")
        .values()
        .all(|&v| v == 1.0));
}

/// The probability verdict: each row's reward is the probability the
/// judge gives the verdict token at its first position, as a direct
/// forward pass of the judge computes it, high where the script says 1.
#[test]
fn a_probability_verdict_is_the_judges_probability_of_its_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let judge = echo_judge(tmp.path());
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 2);
    cfg.generate.temperature = 1.5;
    cfg.reward.kind = RewardKind::Judge;
    cfg.judge.path = judge.clone();
    cfg.judge.template = SCRIPTED.into();
    cfg.judge.chat = false;
    cfg.judge.verdict = JudgeVerdict::Probability;
    cfg.judge.verdict_tokens = vec!["1".into()];
    let dir = tmp.path().join("run");
    run(kind, cfg, &dir, false);
    let tokenizer = weir::gpu::Tokenizer::load(&judge).unwrap();
    let model = weir::gpu::Model::load(&judge, weir::gpu::Device::Cpu, tch::Kind::Float).unwrap();
    let probability = |text: &str| -> f64 {
        let ids = tokenizer.encode(text, false).unwrap();
        let one = tokenizer.encode("1", false).unwrap()[0];
        let ids = tch::Tensor::from_slice(&ids).view([1, -1]);
        let logits = model.logits(&ids, None, None).unwrap();
        let last = logits.get(0).get(-1).log_softmax(-1, tch::Kind::Double);
        last.double_value(&[one]).exp()
    };
    let (p1, p0) = (probability("1"), probability("0"));
    assert!(p1 > 0.5 && p0 < 0.1, "{p1} {p0}");
    let rows = judged_rows(&dir);
    assert!(!rows.is_empty());
    for (_, completion, label, reward, answer) in rows {
        let (want, top) = if completion == label {
            (p1, "1")
        } else {
            (p0, "0")
        };
        assert!((reward - want).abs() < 1e-5, "{reward} vs {want}");
        assert_eq!(answer, top);
    }
}

/// A prompt file read through the policy's chat template (a system
/// prompt, a user message): the judge's `prompt` is the user's question
/// as the file gives it, not the policy's rendered markup; the rollout
/// log keeps the conversation (`prompt_messages`).
#[test]
fn a_judge_reads_the_question_not_the_policys_chat_markup() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 1);
    let questions = (0..6).map(|i| (format!("{i}+{i}="), format!("{}", 2 * i)));
    chat_questions(&mut cfg, tmp.path(), questions);
    cfg.data.label_column = Some("question".into());
    cfg.data.system_prompt = Some("Answer with the sum.".into());
    cfg.reward.kind = RewardKind::Judge;
    cfg.judge.path = echo_judge(tmp.path());
    cfg.judge.template = "{% if prompt == label %}1{% else %}0{% endif %}".into();
    cfg.judge.chat = false;
    cfg.judge.verdict = JudgeVerdict::Probability;
    cfg.judge.verdict_tokens = vec!["1".into()];
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    // The prompt's own column by name is refused, pointing to `prompt`.
    let mut named = cfg;
    named.judge.template = "{{ question }}".into();
    let refused = tmp.path().join("refused");
    let err = super::support::run_err(kind, named, &refused);
    assert!(
        err.contains("judge.template") && err.contains("reads the prompt as `prompt`"),
        "{err}"
    );
    assert!(!refused.exists());
    let rows = judged_rows(&dir);
    assert_eq!(rows.len(), 3 * 4);
    for (_, _, _, _, answer) in &rows {
        assert_eq!(answer, "1", "the judge's prompt was not the question");
    }
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        let messages = b
            .column_by_name(col::PROMPT_MESSAGES)
            .unwrap()
            .as_string::<i32>();
        let prompt = b.column_by_name(col::PROMPT).unwrap().as_string::<i32>();
        for i in 0..b.num_rows() {
            let m: serde_json::Value = serde_json::from_str(messages.value(i)).unwrap();
            assert_eq!(m[0]["content"], "Answer with the sum.");
            assert!(
                prompt.value(i).contains("<|im_start|>user"),
                "{}",
                prompt.value(i)
            );
            assert!(prompt.value(i).contains(m[1]["content"].as_str().unwrap()));
        }
    }
}

/// A judge's bad inputs, each refused in one line naming its key.
#[test]
fn bad_judge_inputs_are_refused_naming_their_key() {
    let tmp = tempfile::tempdir().unwrap();
    let judge = echo_judge(tmp.path());
    let kind = PipelineKind::Grpo;
    let base = || {
        let mut cfg = config(kind, 1);
        cfg.reward.kind = RewardKind::Judge;
        cfg.judge.path = judge.clone();
        cfg.judge.chat = false;
        cfg
    };
    type Change<'a> = Box<dyn Fn(&mut weir::pipelines::RunConfig) + 'a>;
    let cases: Vec<(Change, &str)> = vec![
        (
            Box::new(|c| c.judge.path = tmp.path().join("nowhere")),
            "judge.path",
        ),
        (
            Box::new(|c| c.judge.pattern = r"\d+".into()),
            "judge.pattern",
        ),
        (
            Box::new(|c| {
                c.judge.verdict = JudgeVerdict::Probability;
                c.judge.verdict_tokens = vec!["123456789".into()];
            }),
            "judge.verdict_tokens",
        ),
        (
            Box::new(|c| c.judge.template = "{{ question }}".into()),
            "judge.template",
        ),
        (
            Box::new(|c| c.judge.template = "{% if %}".into()),
            "judge.template",
        ),
        (
            Box::new(|c| c.judge.unparsed_reward = 1.0),
            "judge.unparsed_reward",
        ),
    ];
    for (i, (change, key)) in cases.iter().enumerate() {
        let mut cfg = base();
        change(&mut cfg);
        let dir = tmp.path().join(format!("bad-{i}"));
        let err = super::support::run_err(kind, cfg, &dir);
        assert!(err.contains(key), "{key}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!dir.exists(), "{key}: the run folder was written");
    }
}
