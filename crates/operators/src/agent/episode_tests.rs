//! The episode runner's tests: scripted policies and environments, budgets,
//! and a model's turns against a forward pass.

use super::*;
use crate::agent::environment::{EnvFault, EnvStep};
use crate::agent::environment::{Environment, Observation};
use crate::agent::observe::tests::{tokenizer_with, CHATML_TOOLS};
use crate::agent::tool_calls::Hermes;
use crate::agent::tools::{schemas, Calculator};
use serde_json::{json, Value};

/// A policy that says what it is told, turn by turn.
struct Script {
    turns: Vec<Vec<i64>>,
    contexts: Vec<Vec<i64>>,
    /// Whether each turn ends on the end-of-turn token.
    end: i64,
}

impl TurnPolicy for Script {
    fn sample(&mut self, context: &[i64], max_new: usize) -> Result<Sampled, String> {
        self.contexts.push(context.to_vec());
        let mut tokens = self.turns.remove(0);
        let stopped = tokens.last() == Some(&self.end) && tokens.len() <= max_new;
        tokens.truncate(max_new);
        let logprobs = (0..tokens.len()).map(|i| -0.1 * (i + 1) as f32).collect();
        Ok(Sampled {
            tokens,
            logprobs,
            sum_pi_squared: Vec::new(),
            stopped,
        })
    }
}

fn scripted(setup: &Setup, turns: Vec<Vec<i64>>) -> Script {
    Script {
        turns,
        contexts: Vec::new(),
        end: setup.end,
    }
}

struct Setup {
    tokenizer: Tokenizer,
    tools: Vec<Box<dyn Tool>>,
    end: i64,
    _dir: tempfile::TempDir,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer_with(CHATML_TOOLS, dir.path());
    let end = tokenizer.encode("<|im_end|>", false).unwrap();
    assert_eq!(end.len(), 1);
    Setup {
        tokenizer,
        tools: vec![Box::new(Calculator)],
        end: end[0],
        _dir: dir,
    }
}

fn runner<'a>(setup: &'a Setup, budgets: Budgets) -> EpisodeRunner<'a> {
    EpisodeRunner {
        tokenizer: &setup.tokenizer,
        parser: &Hermes,
        tools: &setup.tools,
        end_of_turn: "<|im_end|>".into(),
        budgets,
        on_error: OnError::Observe,
    }
}

fn turn(setup: &Setup, text: &str) -> Vec<i64> {
    let mut ids = setup.tokenizer.encode(text, false).unwrap();
    ids.push(setup.end);
    ids
}

const BUDGETS: Budgets = Budgets {
    max_turns: 4,
    max_tokens: 1000,
    max_observation_tokens: 100,
};

const CALL: &str = "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"123*456\"}}</tool_call>";

#[test]
fn a_tool_turn_then_an_answer_is_one_trajectory_with_exact_kinds() {
    let setup = setup();
    let messages = [json!({"role": "user", "content": "123*456?"})];
    let prompt = setup
        .tokenizer
        .encode_conversation(&messages, Some(&schemas(&setup.tools)), true)
        .unwrap();
    let (first, last) = (turn(&setup, CALL), turn(&setup, "56088"));
    let mut script = scripted(&setup, vec![first.clone(), last.clone()]);
    let episode = runner(&setup, BUDGETS)
        .run(&mut script, &messages, &prompt)
        .unwrap();
    assert_eq!(episode.finish, Finish::Stop);
    assert_eq!(episode.turns_taken, 2);
    // Generated ids are the sampled ones, in place.
    let (generated, observation, boundary) = episode.counts();
    assert_eq!(generated, first.len() + last.len());
    assert_eq!(generated + observation + boundary, episode.tokens.len());
    assert_eq!(&episode.tokens[..first.len()], &first[..]);
    assert_eq!(
        &episode.tokens[episode.tokens.len() - last.len()..],
        &last[..]
    );
    // The boundary is the newline after <|im_end|> (the one verl#6501
    // dropped); the observation the template's tool turn and the next
    // generation prompt.
    let boundary_at = first.len();
    assert_eq!(episode.kinds[boundary_at], TokenKind::Boundary);
    let observed: Vec<i64> = episode
        .tokens
        .iter()
        .zip(&episode.kinds)
        .filter(|(_, k)| **k == TokenKind::Observation)
        .map(|(t, _)| *t)
        .collect();
    let expected = "<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(observed, setup.tokenizer.encode(expected, false).unwrap());
    // Log-probs on generated tokens only, none a dummy on a template token
    // (SkyRL#758); turns numbered.
    assert!(episode
        .logprobs
        .iter()
        .zip(&episode.kinds)
        .all(|(lp, k)| lp.is_some() == (*k == TokenKind::Generated)));
    assert_eq!(episode.turns.first(), Some(&0));
    assert_eq!(episode.turns.last(), Some(&1));
    // The second turn sampled after exactly the prompt and the response so far.
    let mut context = prompt.clone();
    context.extend_from_slice(&episode.tokens[..episode.tokens.len() - last.len()]);
    assert_eq!(script.contexts[1], context);
    let call = &episode.calls[..];
    assert_eq!(call.len(), 1);
    assert_eq!(
        (
            call[0].turn,
            call[0].tool.as_str(),
            call[0].arguments.as_str()
        ),
        (0, "calculator", "{\"expression\":\"123*456\"}")
    );
    assert_eq!((call[0].output.as_str(), call[0].ok), ("56088", true));
    assert!(call[0].seconds >= 0.0);
    // The whole episode is the template's render of the conversation.
    let mut all = messages.to_vec();
    all.push(json!({"role": "assistant", "content": CALL}));
    all.push(json!({"role": "tool", "name": "calculator", "content": "56088"}));
    all.push(json!({"role": "assistant", "content": "56088"}));
    let rendered = setup
        .tokenizer
        .render_chat(&all, Some(&schemas(&setup.tools)), false)
        .unwrap();
    let pieced = setup
        .tokenizer
        .decode(&[prompt, episode.tokens.clone()].concat(), false)
        .unwrap();
    assert_eq!(format!("{pieced}\n"), rendered);
}

/// A first turn forced (a tool call), the rest sampled by `model`.
struct Forced<'a> {
    first: Option<Vec<i64>>,
    model: ModelPolicy<'a>,
}

impl TurnPolicy for Forced<'_> {
    fn sample(&mut self, context: &[i64], max_new: usize) -> Result<Sampled, String> {
        match self.first.take() {
            Some(tokens) => Ok(Sampled {
                logprobs: vec![0.0; tokens.len()],
                sum_pi_squared: Vec::new(),
                tokens,
                stopped: true,
            }),
            None => self.model.sample(context, max_new),
        }
    }
}

#[test]
fn a_models_turn_after_an_observation_has_the_log_probs_of_a_pass_over_the_trajectory() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/arith-sft");
    let model = weir_gpu::Model::load(&dir, weir_gpu::Device::Cpu, tch::Kind::Float).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let end = tokenizer.encode("<|im_end|>", false).unwrap();
    let tools: Vec<Box<dyn Tool>> = vec![Box::new(Calculator)];
    let runner = EpisodeRunner {
        tokenizer: &tokenizer,
        parser: &Hermes,
        tools: &tools,
        end_of_turn: "<|im_end|>".into(),
        budgets: Budgets {
            max_turns: 2,
            max_tokens: 96,
            max_observation_tokens: 32,
        },
        on_error: OnError::Observe,
    };
    let messages = [json!({"role": "user", "content": "12+34="})];
    let prompt = tokenizer
        .encode_conversation(&messages, None, true)
        .unwrap();
    let mut first = tokenizer.encode(CALL, false).unwrap();
    first.extend_from_slice(&end);
    let params = weir_gpu::SamplingParams {
        temperature: 1.0,
        seed: 7,
        eos_token_ids: end.clone(),
        ..Default::default()
    };
    for backend in [
        weir_gpu::generate::Backend::Auto,
        weir_gpu::generate::Backend::Torch,
    ] {
        let mut policy = Forced {
            first: Some(first.clone()),
            model: ModelPolicy::new(&model, params.clone(), 3).on(backend),
        };
        let episode = runner.run(&mut policy, &messages, &prompt).unwrap();
        let sampled: Vec<usize> = (0..episode.tokens.len())
            .filter(|&i| episode.turns[i] == 1)
            .collect();
        assert!(!sampled.is_empty(), "the model sampled a second turn");
        assert!(sampled
            .iter()
            .all(|&i| episode.kinds[i] == TokenKind::Generated));
        assert_eq!(episode.kinds[first.len()], TokenKind::Boundary);
        // An independent forward pass over prompt ++ the whole response.
        let (logprobs, _) = crate::training::sequences::response_logprobs(
            &model,
            std::slice::from_ref(&prompt),
            std::slice::from_ref(&episode.tokens),
            1.0,
            0,
            false,
        )
        .unwrap();
        for i in sampled {
            let want = logprobs.double_value(&[0, i as i64]);
            let got = f64::from(episode.logprobs[i].unwrap());
            assert!(
                (want - got).abs() < 1e-4,
                "{backend:?}, token {i}: sampled with {got}, a pass gives {want}"
            );
        }
    }
}

/// Guess the row's number: "higher" / "lower" as raw text, or as a
/// user message; −0.1 a wrong guess, 1 the right one (and done).
struct Guess {
    target: i64,
    as_messages: bool,
    fail_at: Option<usize>,
    steps: usize,
    closed: bool,
}

impl Environment for Guess {
    fn reset(&mut self, row: &Value, _prompt: &str) -> Result<Option<String>, EnvFault> {
        self.target = row["target"].as_i64().ok_or("the row has no target")?;
        Ok(None)
    }

    fn step(&mut self, action: &str) -> Result<EnvStep, EnvFault> {
        self.steps += 1;
        if self.fail_at == Some(self.steps) {
            return Err("the game crashed".into());
        }
        let guess: i64 = action
            .trim()
            .parse()
            .map_err(|_| EnvFault::Error(format!("{action:?} is no number")))?;
        let hint = if guess < self.target {
            "higher"
        } else {
            "lower"
        };
        let observation = if self.as_messages {
            Observation::Messages(vec![json!({"role": "user", "content": hint})])
        } else {
            Observation::Text(format!(" {hint}\n"))
        };
        Ok(EnvStep {
            observation,
            reward: if guess == self.target { 1.0 } else { -0.1 },
            done: guess == self.target,
        })
    }

    fn close(&mut self) {
        self.closed = true;
    }
}

fn guess(as_messages: bool, fail_at: Option<usize>) -> Guess {
    Guess {
        target: 0,
        as_messages,
        fail_at,
        steps: 0,
        closed: false,
    }
}

#[test]
fn an_environment_answers_each_turn_with_an_observation_and_a_reward() {
    let setup = setup();
    let messages = [json!({"role": "user", "content": "Guess my number."})];
    let prompt = setup
        .tokenizer
        .encode_conversation(&messages, None, true)
        .unwrap();
    let row = json!({"target": 7});
    let turns = || vec![turn(&setup, "5"), turn(&setup, "8"), turn(&setup, "7")];
    let mut script = scripted(&setup, turns());
    let mut env = guess(false, None);
    let episode = runner(&setup, BUDGETS)
        .run_with(&mut script, &mut env, &row, &messages, &prompt)
        .unwrap();
    assert_eq!(episode.finish, Finish::Stop);
    assert_eq!(episode.turn_rewards, [-0.1, -0.1, 1.0]);
    assert!(env.closed);
    // Raw text: no boundary, the feedback's own tokens straight after the turn.
    let t = turn(&setup, "5");
    let higher = setup.tokenizer.encode(" higher\n", false).unwrap();
    assert_eq!(
        &episode.tokens[t.len()..t.len() + higher.len()],
        &higher[..]
    );
    assert!(episode.kinds[t.len()..t.len() + higher.len()]
        .iter()
        .all(|k| *k == TokenKind::Observation));
    assert_eq!(episode.counts().2, 0, "no boundary tokens");

    // As messages, the template renders them after the turn's boundary.
    let mut script = scripted(&setup, turns());
    let episode = runner(&setup, BUDGETS)
        .run_with(
            &mut script,
            &mut guess(true, None),
            &row,
            &messages,
            &prompt,
        )
        .unwrap();
    assert_eq!(episode.kinds[t.len()], TokenKind::Boundary);
    let expected = setup
        .tokenizer
        .encode(
            "<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    assert_eq!(
        &episode.tokens[t.len() + 1..t.len() + 1 + expected.len()],
        &expected[..]
    );

    // A failing environment's error is the next observation, as raw text…
    let mut script = scripted(&setup, turns());
    let observed = runner(&setup, BUDGETS)
        .run_with(
            &mut script,
            &mut guess(false, Some(2)),
            &row,
            &messages,
            &prompt,
        )
        .unwrap();
    assert_eq!(observed.finish, Finish::Stop);
    assert_eq!(observed.turn_rewards, [-0.1, 0.0, 1.0]);
    let error = setup
        .tokenizer
        .encode("\nerror: the game crashed\n", false)
        .unwrap();
    let at = 2 * t.len() + higher.len();
    assert_eq!(&observed.tokens[at..at + error.len()], &error[..]);
    // …or, with OnError::End, it ends the episode, saying why; so does a
    // row it cannot start from, whatever on_error says.
    let ending = EpisodeRunner {
        on_error: OnError::End,
        ..runner(&setup, BUDGETS)
    };
    let mut script = scripted(&setup, turns());
    let failed = ending
        .run_with(
            &mut script,
            &mut guess(false, Some(2)),
            &row,
            &messages,
            &prompt,
        )
        .unwrap();
    assert_eq!((failed.finish, failed.turns_taken), (Finish::EnvError, 2));
    assert_eq!(
        failed.env_error.as_deref(),
        Some("turn 1: the game crashed")
    );
    let mut script = scripted(&setup, turns());
    let unstarted = runner(&setup, BUDGETS)
        .run_with(
            &mut script,
            &mut guess(false, None),
            &json!({}),
            &messages,
            &prompt,
        )
        .unwrap();
    assert_eq!(unstarted.finish, Finish::EnvError);
    assert!(unstarted.tokens.is_empty());
    // Out of turns while the game goes on.
    let mut script = scripted(&setup, turns());
    let short = runner(
        &setup,
        Budgets {
            max_turns: 2,
            ..BUDGETS
        },
    )
    .run_with(
        &mut script,
        &mut guess(false, None),
        &row,
        &messages,
        &prompt,
    )
    .unwrap();
    assert_eq!(
        (short.finish, short.turn_rewards.as_slice()),
        (Finish::MaxTurns, &[-0.1, -0.1][..])
    );
}

#[test]
fn budgets_end_episodes_with_their_reason() {
    let setup = setup();
    let messages = [json!({"role": "user", "content": "go"})];
    let prompt = setup
        .tokenizer
        .encode_conversation(&messages, None, true)
        .unwrap();
    let call = turn(&setup, CALL);
    let run = |budgets: Budgets, turns: Vec<Vec<i64>>| {
        let mut script = scripted(&setup, turns);
        runner(&setup, budgets)
            .run(&mut script, &messages, &prompt)
            .unwrap()
    };
    // The last allowed turn calls a tool.
    let one = run(
        Budgets {
            max_turns: 1,
            ..BUDGETS
        },
        vec![call.clone()],
    );
    assert_eq!(
        (one.finish, one.turns_taken, one.tokens.len()),
        (Finish::MaxTurns, 1, call.len())
    );
    // A turn cut by the budget: no end-of-turn token appended after it
    // (SkyRL#758 gave such a token mask 1 and a dummy log-prob).
    let cut = run(
        Budgets {
            max_tokens: 5,
            ..BUDGETS
        },
        vec![call.clone()],
    );
    assert_eq!((cut.finish, cut.tokens.len()), (Finish::Length, 5));
    assert_eq!(cut.tokens, call[..5]);
    assert!(cut.logprobs.iter().all(Option::is_some));
    // An observation that fits exactly is kept (verl#6309); one token less and it ends the episode.
    let full = run(BUDGETS, vec![call.clone(), turn(&setup, "x")]);
    let through_observation = full.tokens.len() - turn(&setup, "x").len();
    let exact = run(
        Budgets {
            max_tokens: through_observation,
            ..BUDGETS
        },
        vec![call.clone(), turn(&setup, "x")],
    );
    assert_eq!(exact.tokens, full.tokens[..through_observation]);
    assert_eq!(exact.finish, Finish::Length);
    let short = run(
        Budgets {
            max_tokens: through_observation - 1,
            ..BUDGETS
        },
        vec![call.clone()],
    );
    assert_eq!(
        (short.finish, short.tokens.len()),
        (Finish::Length, call.len())
    );
    assert!(short.kinds.iter().all(|k| *k == TokenKind::Generated));
}

#[test]
fn a_long_tool_output_is_cut_with_a_marker_and_a_bad_call_is_an_error_observation() {
    let setup = setup();
    let messages = [json!({"role": "user", "content": "go"})];
    let prompt = setup
        .tokenizer
        .encode_conversation(&messages, None, true)
        .unwrap();
    let big = "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"9^900\"}}</tool_call>";
    let mut script = scripted(
        &setup,
        vec![
            turn(&setup, big),
            turn(&setup, "<tool_call>{\"name\": \"search\"}</tool_call>"),
            turn(&setup, "done"),
        ],
    );
    let budgets = Budgets {
        max_observation_tokens: 20,
        ..BUDGETS
    };
    let episode = runner(&setup, budgets)
        .run(&mut script, &messages, &prompt)
        .unwrap();
    assert_eq!(episode.finish, Finish::Stop);
    let cut = &episode.calls[0].output;
    assert!(cut.ends_with("more tokens of output not shown]"), "{cut}");
    assert!(
        setup
            .tokenizer
            .encode(cut.split('\n').next().unwrap(), false)
            .unwrap()
            .len()
            <= 20
    );
    assert!(!episode.calls[1].ok);
    assert!(episode.calls[1]
        .output
        .contains("there is no tool \"search\""));
}

#[test]
fn with_on_error_end_a_failed_call_ends_the_episode_as_a_tool_error() {
    let setup = setup();
    let messages = [json!({"role": "user", "content": "go"})];
    let prompt = setup
        .tokenizer
        .encode_conversation(&messages, None, true)
        .unwrap();
    let bad = turn(
        &setup,
        "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1/0\"}}</tool_call>",
    );
    let mut script = scripted(&setup, vec![bad.clone(), turn(&setup, "done")]);
    let ending = EpisodeRunner {
        on_error: OnError::End,
        ..runner(&setup, BUDGETS)
    };
    let episode = ending.run(&mut script, &messages, &prompt).unwrap();
    assert_eq!(episode.finish, Finish::ToolError);
    assert_eq!(episode.finish.name(), "tool_error");
    // The call is recorded; nothing of its answer is appended.
    assert_eq!(episode.calls.len(), 1);
    assert!(!episode.calls[0].ok);
    assert_eq!(episode.tokens, bad);
}

/// Rewrites the prompt at reset (as OpenRLHF's agents may), or times out.
struct Rewrites {
    prompt: Option<String>,
    time_out_at_step: bool,
}

impl Environment for Rewrites {
    fn reset(&mut self, _row: &Value, prompt: &str) -> Result<Option<String>, EnvFault> {
        Ok(self.prompt.clone().or_else(|| Some(prompt.to_string())))
    }

    fn step(&mut self, _action: &str) -> Result<EnvStep, EnvFault> {
        if self.time_out_at_step {
            return Err(EnvFault::Timeout("no answer within 0.1 s".into()));
        }
        Ok(EnvStep {
            observation: Observation::Text(String::new()),
            reward: 0.5,
            done: true,
        })
    }
}

#[test]
fn a_reset_may_rewrite_the_prompt_and_a_timeout_always_ends_the_episode() {
    let setup = setup();
    let messages = [json!({"role": "user", "content": "go"})];
    let prompt = setup
        .tokenizer
        .encode_conversation(&messages, None, true)
        .unwrap();
    let row = json!({});
    // The same text back: the prompt's tokens are kept as they are.
    let mut script = scripted(&setup, vec![turn(&setup, "a")]);
    let mut same = Rewrites {
        prompt: None,
        time_out_at_step: false,
    };
    let episode = runner(&setup, BUDGETS)
        .run_with(&mut script, &mut same, &row, &messages, &prompt)
        .unwrap();
    assert_eq!(episode.prompt, None);
    assert_eq!(script.contexts[0], prompt);
    // Another text: tokenized alone, it is what the model reads.
    let mut script = scripted(&setup, vec![turn(&setup, "a")]);
    let mut other = Rewrites {
        prompt: Some("Question: go\nAnswer:".into()),
        time_out_at_step: false,
    };
    let episode = runner(&setup, BUDGETS)
        .run_with(&mut script, &mut other, &row, &messages, &prompt)
        .unwrap();
    let want = setup
        .tokenizer
        .encode("Question: go\nAnswer:", false)
        .unwrap();
    assert_eq!(episode.prompt.as_deref(), Some(&want[..]));
    assert_eq!(script.contexts[0], want);
    assert_eq!(episode.turn_rewards, [0.5]);
    // A timeout ends the episode even when errors are observed.
    let mut script = scripted(&setup, vec![turn(&setup, "a"), turn(&setup, "b")]);
    let mut slow = Rewrites {
        prompt: None,
        time_out_at_step: true,
    };
    let episode = runner(&setup, BUDGETS)
        .run_with(&mut script, &mut slow, &row, &messages, &prompt)
        .unwrap();
    assert_eq!(episode.finish, Finish::Timeout);
    assert_eq!(
        episode.env_error.as_deref(),
        Some("turn 0: no answer within 0.1 s")
    );
}

/// AReaL#647, TRL#5224: a turn's ids are kept as sampled, even where its
/// text would tokenize otherwise. The turn here spells "calculator" one
/// character per token, which BPE encodes in fewer tokens; the episode and
/// the next turn's context hold the sampled ids, not the re-encoded ones.
#[test]
fn a_turns_ids_are_kept_as_sampled_where_its_text_would_encode_otherwise() {
    let setup = setup();
    let messages = [json!({"role": "user", "content": "go"})];
    let prompt = setup
        .tokenizer
        .encode_conversation(&messages, None, true)
        .unwrap();
    let word = "calculator";
    let mut spelt: Vec<i64> = word
        .chars()
        .flat_map(|c| setup.tokenizer.encode(&c.to_string(), false).unwrap())
        .collect();
    let canonical = setup.tokenizer.encode(word, false).unwrap();
    assert_ne!(spelt, canonical, "the test needs a word BPE merges");
    spelt.push(setup.end);
    let mut script = scripted(&setup, vec![spelt.clone()]);
    let episode = runner(&setup, BUDGETS)
        .run(&mut script, &messages, &prompt)
        .unwrap();
    assert_eq!(episode.finish, Finish::Stop);
    assert_eq!(episode.tokens, spelt);
    // With a tool call spelt so, the next turn's context holds those ids too.
    let mut call: Vec<i64> = CALL
        .chars()
        .flat_map(|c| setup.tokenizer.encode(&c.to_string(), false).unwrap())
        .collect();
    call.push(setup.end);
    let mut script = scripted(&setup, vec![call.clone(), turn(&setup, "56088")]);
    let episode = runner(&setup, BUDGETS)
        .run(&mut script, &messages, &prompt)
        .unwrap();
    assert_eq!(episode.calls.len(), 1, "the call was read from its text");
    assert_eq!(&episode.tokens[..call.len()], &call[..]);
    assert_eq!(
        &script.contexts[1][prompt.len()..prompt.len() + call.len()],
        &call[..]
    );
}
