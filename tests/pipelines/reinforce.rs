//! The REINFORCE family: ReMax's greedy baseline.

use arrow::array::AsArray;
use arrow::datatypes::Float32Type;
use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rollout::col;
use weir::pipelines::PipelineKind;

use super::support::{config, fixture, metric, run, u64s};

#[test]
fn remax_subtracts_the_reward_of_each_prompts_greedy_response() {
    use weir::operators::tasks::arith;
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Remax;
    let mut cfg = config(kind, 2);
    cfg.run.max_staleness = 0;
    cfg.algorithm.kl_coef = 0.0;
    cfg.generate.temperature = 1.5;
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    // The greedy rows were scored and left: the log has the sampled ones.
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 2 * 3 * 4);
    assert!(batches
        .iter()
        .all(|b| b.column_by_name("greedy_baseline").is_none()));
    // Step 0's baseline is the reward of the starting policy's greedy answer.
    let model = weir::gpu::Model::load(
        &fixture("arith-sft"),
        weir::gpu::Device::Cpu,
        tch::Kind::Float,
    )
    .unwrap();
    let tok = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let params = weir::gpu::SamplingParams {
        max_new_tokens: cfg.generate.max_new_tokens,
        greedy: true,
        eos_token_ids: tok.eos_token_ids().to_vec(),
        ..Default::default()
    };
    let mut checked = 0;
    for b in &batches {
        let steps = u64s(b, col::STEP);
        let prompts = b
            .column_by_name(col::PROMPT_TOKENS)
            .unwrap()
            .as_list::<i32>();
        let answers = b.column_by_name("answer").unwrap().as_string::<i32>();
        let f32s = |name: &str| {
            b.column_by_name(name)
                .unwrap()
                .as_primitive::<Float32Type>()
                .values()
                .to_vec()
        };
        let (rewards, baselines) = (f32s(col::REWARD), f32s("reward_baseline"));
        let advantages = b.column_by_name(col::ADVANTAGES).unwrap().as_list::<i32>();
        for i in 0..b.num_rows() {
            // Without a KL term each token's advantage is reward − baseline.
            let a = advantages.value(i);
            let a = a.as_primitive::<Float32Type>();
            for t in 0..a.len() {
                assert!((a.value(t) - (rewards[i] - baselines[i])).abs() < 1e-6);
            }
            if steps[i] == 0 {
                let tokens: Vec<i64> = prompts
                    .value(i)
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec();
                let g = weir::gpu::generate(&model, &[tokens], &params).unwrap();
                let text = tok.decode(&g[0].tokens, true).unwrap();
                let want = arith::exact_match(&text, answers.value(i));
                assert_eq!(f64::from(baselines[i]), want, "row {i}: {text:?}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 3 * 4);
    let baseline = metric(&dir, "advantage", "reward_baseline");
    assert_eq!(baseline.len(), 2, "{baseline:?}");
}
