//! Training support: gradient checkpointing gives the gradients of a plain
//! backward pass.

use super::*;

fn gradients(model: &Model) -> Vec<(String, Tensor)> {
    model
        .named_tensors()
        .into_iter()
        .map(|(name, t)| (name, t.grad().copy()))
        .collect()
}

fn zero_gradients(model: &Model) {
    for (_, mut t) in model.named_tensors() {
        t.zero_grad();
    }
}

#[test]
fn checkpointed_backward_gives_the_plain_gradients() {
    for name in ["tiny-qwen2", "tiny-qwen3", "tiny-llama"] {
        let model = load(name, Kind::Float);
        tch::manual_seed(3);
        let vocab = model.config.vocab_size;
        let ids = Tensor::randint(vocab, [3, 12], (Kind::Int64, tch::Device::Cpu));
        // Left padding on the first row, right padding on the second.
        let mask = Tensor::ones([3, 12], (Kind::Int64, tch::Device::Cpu));
        let _ = mask.narrow(1, 0, 4).get(0).fill_(0);
        let _ = mask.narrow(1, 9, 3).get(1).fill_(0);
        let weights = Tensor::randn([3, 11], (Kind::Float, tch::Device::Cpu));
        let loss_of = |logits: &Tensor| -> Tensor {
            let logp = logits
                .narrow(1, 0, 11)
                .log_softmax(-1, Kind::Float)
                .gather(-1, &ids.narrow(1, 1, 11).unsqueeze(-1), false)
                .squeeze_dim(-1);
            (logp * &weights * mask.narrow(1, 1, 11)).sum(Kind::Float)
        };

        zero_gradients(&model);
        let plain_loss = loss_of(&model.logits(&ids, Some(&mask), None).unwrap());
        plain_loss.backward();
        let plain = gradients(&model);

        zero_gradients(&model);
        let loss = model
            .backward_checkpointed(&ids, Some(&mask), |logits| {
                Ok::<_, weir_gpu::ModelError>(loss_of(logits))
            })
            .unwrap();
        let checkpointed = gradients(&model);

        let (a, b) = (plain_loss.double_value(&[]), loss.double_value(&[]));
        assert!(
            (a - b).abs() < 1e-5 * a.abs().max(1.0),
            "{name}: loss {a} vs {b}"
        );
        for ((n, g), (_, h)) in plain.iter().zip(&checkpointed) {
            let largest = g.abs().max().double_value(&[]);
            assert!(largest > 0.0, "{name}: {n} got no gradient");
            let d = (g - h).abs().max().double_value(&[]);
            assert!(
                d < 1e-5 * largest.max(1e-3),
                "{name}: gradient of {n} differs by {d:e} (largest {largest:e})"
            );
        }
    }
}

#[test]
fn response_logits_run_each_prompt_once_with_the_same_values_and_gradients() {
    let prompts = vec![
        vec![1i64, 286, 202, 305],
        vec![302, 592],
        vec![1i64, 286, 202, 305],
        vec![302, 592],
        vec![1i64, 286, 202, 305],
    ];
    let responses = vec![
        vec![5i64, 6, 7],
        vec![8],
        vec![9, 10, 11, 12, 13],
        vec![],
        vec![14, 15],
    ];
    for name in ["tiny-qwen3", "tiny-llama"] {
        let model = load(name, Kind::Float);
        let weight = |r: usize, j: usize| 0.3 + (r * 7 + j * 3) as f64 * 0.11;

        // Each full row on its own.
        zero_gradients(&model);
        let mut plain_rows = Vec::new();
        let mut plain_loss = Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
        for (r, (p, resp)) in prompts.iter().zip(&responses).enumerate() {
            if resp.is_empty() {
                plain_rows.push(None);
                continue;
            }
            let seq: Vec<i64> = p.iter().chain(resp).copied().collect();
            let logits = model
                .logits(&Tensor::from_slice(&seq).view([1, -1]), None, None)
                .unwrap();
            let at = logits
                .get(0)
                .narrow(0, p.len() as i64 - 1, resp.len() as i64);
            let logp = at.log_softmax(-1, Kind::Float).gather(
                -1,
                &Tensor::from_slice(resp).unsqueeze(-1),
                false,
            );
            for j in 0..resp.len() {
                plain_loss += logp.get(j as i64).get(0) * weight(r, j);
            }
            plain_rows.push(Some(at.detach()));
        }
        plain_loss.backward();
        let plain = gradients(&model);

        zero_gradients(&model);
        let shared = model.response_logits(&prompts, &responses).unwrap();
        assert_eq!(shared.logits.size()[..2], [5, 5]);
        let logp = shared
            .logits
            .log_softmax(-1, Kind::Float)
            .gather(-1, &shared.targets.unsqueeze(-1), false)
            .squeeze_dim(-1);
        let mut loss = Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
        for (r, resp) in responses.iter().enumerate() {
            let expected_mask: Vec<f32> = (0..5)
                .map(|j| if j < resp.len() { 1.0 } else { 0.0 })
                .collect();
            assert_eq!(
                Vec::<f32>::try_from(shared.mask.get(r as i64)).unwrap(),
                expected_mask
            );
            for j in 0..resp.len() {
                loss += logp.get(r as i64).get(j as i64) * weight(r, j);
            }
            if let Some(at) = &plain_rows[r] {
                let ours = shared.logits.get(r as i64).narrow(0, 0, resp.len() as i64);
                let d = (ours - at).abs().max().double_value(&[]);
                assert!(d < 1e-4, "{name}: logits of row {r} differ by {d:e}");
            }
        }
        loss.backward();
        let ours = gradients(&model);
        let (a, b) = (plain_loss.double_value(&[]), loss.double_value(&[]));
        assert!(
            (a - b).abs() < 1e-4 * a.abs().max(1.0),
            "{name}: loss {a} vs {b}"
        );
        for ((n, g), (_, h)) in plain.iter().zip(&ours) {
            let largest = g.abs().max().double_value(&[]);
            let d = (g - h).abs().max().double_value(&[]);
            assert!(
                d < 1e-4 * largest.max(1e-3),
                "{name}: gradient of {n} differs by {d:e} (largest {largest:e})"
            );
        }
    }
}

/// A step leaves no gradient behind (PyTorch's `zero_grad(set_to_none)`),
/// so their memory is free until the next backward pass; and steps taken
/// that way move the weights exactly as steps over gradients zeroed in
/// place would (the same sum, accumulated over two micro-batches).
#[test]
fn a_step_frees_the_gradients_and_the_next_backward_makes_them_anew() {
    use weir_gpu::optim::{AdamWConfig, Optimizer};
    let dir = fixtures().join("models/tiny-llama");
    let model = Model::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let mut opt = Optimizer::adamw(&model, AdamWConfig::default()).unwrap();
    let ids = Tensor::from_slice(&[1i64, 286, 202, 305, 29]).view([1, -1]);
    let loss = |scale: f64| {
        model
            .logits(&ids, None, None)
            .unwrap()
            .square()
            .mean(Kind::Float)
            * scale
    };
    for step in 0..3 {
        opt.zero_grad();
        // Two micro-batches accumulate into gradients the first one made.
        loss(1.0).backward();
        loss(0.5).backward();
        let grads: Vec<Tensor> = model
            .named_tensors()
            .iter()
            .map(|(_, p)| p.grad())
            .collect();
        assert!(
            grads.iter().all(Tensor::defined),
            "step {step}: a gradient is missing"
        );
        if step == 0 {
            // 1.5 × the gradient of one pass, as zeroed gradients would hold.
            opt.zero_grad();
            assert!(model
                .named_tensors()
                .iter()
                .all(|(_, p)| !p.grad().defined()));
            loss(1.5).backward();
            let once: Vec<Tensor> = model
                .named_tensors()
                .iter()
                .map(|(_, p)| p.grad().copy())
                .collect();
            for (a, b) in grads.iter().zip(&once) {
                assert!((a - b).abs().max().double_value(&[]) < 1e-5);
            }
        }
        opt.step(Some(1.0));
        assert!(
            model
                .named_tensors()
                .iter()
                .all(|(_, p)| !p.grad().defined()),
            "step {step}: gradients kept after the step"
        );
    }
}

/// AdamW on a bf16 model keeps float32 master weights: a run of small
/// updates lands where the float32 model's does, up to the final rounding
/// to bf16, where updating the bf16 weights directly would lose each
/// update smaller than a bf16 step.
#[test]
fn bf16_training_updates_float32_master_weights() {
    use weir_gpu::optim::{AdamWConfig, Optimizer};
    let dir = fixtures().join("models/tiny-llama");
    let run = |kind: Kind| {
        let model = Model::load(&dir, Device::Cpu, kind).unwrap();
        let config = AdamWConfig {
            lr: 2e-5,
            ..AdamWConfig::default()
        };
        let mut opt = Optimizer::adamw(&model, config).unwrap();
        for _ in 0..30 {
            opt.zero_grad();
            // The same gradient for both kinds and every step: a fixed sign per entry.
            let loss: Tensor = model
                .named_tensors()
                .into_iter()
                .map(|(_, p)| {
                    let n = p.numel() as i64;
                    let sign = (Tensor::arange(n, (Kind::Float, p.device())) * 0.37)
                        .sin()
                        .sign()
                        .view(p.size().as_slice());
                    (p.to_kind(Kind::Float) * sign).sum(Kind::Float)
                })
                .reduce(|a, b| a + b)
                .unwrap();
            loss.backward();
            opt.step(None);
        }
        let (state, _) = opt.state();
        (model.named_tensors(), state)
    };
    let (f32_weights, f32_state) = run(Kind::Float);
    let (bf16_weights, bf16_state) = run(Kind::BFloat16);
    assert!(bf16_state.iter().any(|(n, _)| n.starts_with("master.")));
    assert!(!f32_state.iter().any(|(n, _)| n.starts_with("master.")));
    let initial = Model::load(&dir, Device::Cpu, Kind::Float)
        .unwrap()
        .named_tensors();
    let mut moved = 0i64;
    for (((name, a), (_, b)), (_, start)) in f32_weights.iter().zip(&bf16_weights).zip(&initial) {
        let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
        // The bf16 run starts from the checkpoint rounded to bf16 and takes
        // the float32 run's steps (the gradients' signs make Adam's steps
        // equal): its weight is that sum rounded, within one bf16 step (2⁻⁸ relative).
        let start_bf16 = start.to_kind(Kind::BFloat16).to_kind(Kind::Float);
        let want = (&start_bf16 + (&a - start))
            .to_kind(Kind::BFloat16)
            .to_kind(Kind::Float);
        let step = want.abs() * 2f64.powi(-8) + 1e-30;
        let off = ((&b - &want).abs() - &step).max().double_value(&[]);
        assert!(
            off <= 1e-7,
            "{name}: bf16 weight off by {off:e} beyond a bf16 step"
        );
        // Weights the float32 run moved by more than two bf16 steps: where
        // the bf16 weights were updated directly (each 2e-5 update below
        // half a step) they would not have moved, and the check above fails.
        let far = (&a - start).abs().gt_tensor(&(start.abs() * 2f64.powi(-7)));
        moved += far.sum(Kind::Int64).int64_value(&[]);
    }
    assert!(
        moved > 1000,
        "{moved} weights moved by more than two bf16 steps"
    );
}

/// Named tensors.
type Named = Vec<(String, Tensor)>;

/// Weights, optimizer state and its step count to start from.
type Resume = (Named, Named, u64);

fn copies(named: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    named.iter().map(|(n, t)| (n.clone(), t.copy())).collect()
}

/// The weights, every rank's optimizer state and state bytes after `steps`
/// steps of `ranks` data-parallel ranks (each with its own input; one rank
/// takes both inputs as two backward passes), the state `shard`ed or not.
fn data_parallel_steps(
    kind: Kind,
    ranks: usize,
    shard: bool,
    steps: usize,
    resume: Option<&Resume>,
) -> (Vec<Named>, Named, Vec<u64>) {
    use weir_gpu::collective::HostGroup;
    use weir_gpu::optim::{AdamWConfig, Optimizer};
    let dir = fixtures().join("models/tiny-llama");
    let inputs = [
        Tensor::from_slice(&[1i64, 286, 202, 305, 29]).view([1, -1]),
        Tensor::from_slice(&[7i64, 11, 93, 4, 250, 31, 2]).view([1, -1]),
    ];
    let group = HostGroup::new(ranks);
    let threads: Vec<_> = (0..ranks)
        .map(|rank| {
            let member = group.member(rank).sharding_optimizer(shard);
            let (dir, inputs) = (
                dir.clone(),
                inputs.iter().map(Tensor::copy).collect::<Vec<_>>(),
            );
            let resume = resume.map(|(w, t, s)| (copies(w), copies(t), *s));
            std::thread::spawn(move || {
                let model = Model::load(&dir, Device::Cpu, kind).unwrap();
                let config = AdamWConfig {
                    lr: 1e-3,
                    weight_decay: 0.01,
                    ..AdamWConfig::default()
                };
                if let Some((weights, _, _)) = &resume {
                    let _guard = tch::no_grad_guard();
                    for ((_, mut p), (_, w)) in model.named_tensors().into_iter().zip(weights) {
                        p.copy_(w);
                    }
                }
                let mut opt = Optimizer::adamw(&model, config).unwrap();
                opt.share_rank0_parameters(&member).unwrap();
                if member.shards_optimizer() {
                    opt.shard(&member).unwrap();
                }
                if let Some((_, state, steps)) = &resume {
                    let wanted = opt.state_names();
                    let mine: Vec<_> = state
                        .iter()
                        .filter(|(n, _)| wanted.contains(n))
                        .map(|(n, t)| (n.clone(), t.shallow_clone()))
                        .collect();
                    opt.load_state(&mine, *steps).unwrap();
                }
                let mine: Vec<&Tensor> = if ranks == 1 {
                    inputs.iter().collect()
                } else {
                    vec![&inputs[rank]]
                };
                for _ in 0..steps {
                    opt.zero_grad();
                    for ids in &mine {
                        let logits = model.logits(ids, None, None).unwrap();
                        (logits.to_kind(Kind::Float).square().mean(Kind::Float) * 10.0).backward();
                    }
                    let mut stats = [1.0];
                    opt.all_reduce_gradients(&member, &mut stats).unwrap();
                    assert_eq!(stats, [ranks as f64]);
                    // A small bound: every step clips.
                    let norm = opt.step_sharded(Some(0.05), &member).unwrap();
                    assert!(norm > 0.05, "{norm}");
                }
                let mut gathered = Vec::new();
                opt.gather_state(&member, |_, _, tensors| {
                    gathered.extend(tensors);
                    Ok(())
                })
                .unwrap();
                (model.named_tensors(), gathered, opt.state_bytes())
            })
        })
        .collect();
    let mut weights = Vec::new();
    let mut states = Vec::new();
    let mut bytes = Vec::new();
    for t in threads {
        let (w, s, b) = t.join().unwrap();
        weights.push(w);
        states.push(s);
        bytes.push(b);
    }
    // Every rank gathered the same whole state.
    for s in &states[1..] {
        assert_bits_equal(&states[0], s, "gathered state");
    }
    (weights, states.swap_remove(0), bytes)
}

fn assert_bits_equal(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    let mut a: Vec<_> = a.iter().collect();
    let mut b: Vec<_> = b.iter().collect();
    a.sort_by(|x, y| x.0.cmp(&y.0));
    b.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(a.len(), b.len(), "{what}: counts");
    for ((n, x), (m, y)) in a.iter().zip(&b) {
        assert_eq!(n, m, "{what}");
        assert!(x.equal(y), "{what}: {n} differs");
    }
}

/// ZeRO: ranks that shard the optimizer state step to the unsharded
/// ranks' weights and state, bit for bit, in float32 and in bf16 (float32
/// masters sharded too), each holding about half the state; a state
/// gathered from sharded ranks resumes on one rank and on two sharded
/// ones to the uninterrupted run's bits.
#[test]
fn sharded_optimizer_ranks_step_to_the_unsharded_bits() {
    for kind in [Kind::Float, Kind::BFloat16] {
        let (plain, plain_state, plain_bytes) = data_parallel_steps(kind, 2, false, 3, None);
        let (sharded, sharded_state, sharded_bytes) = data_parallel_steps(kind, 2, true, 3, None);
        for (p, s) in plain.iter().zip(&sharded) {
            assert_bits_equal(p, s, "weights");
        }
        assert_bits_equal(&plain[0], &plain[1], "ranks' weights");
        assert_bits_equal(&plain_state, &sharded_state, "optimizer state");
        assert_eq!(plain_bytes[0], plain_bytes[1]);
        let total = plain_bytes[0];
        assert_eq!(
            sharded_bytes.iter().sum::<u64>(),
            total,
            "{sharded_bytes:?}"
        );
        for b in &sharded_bytes {
            // Within one parameter of an even split (the embedding is the largest).
            assert!(
                (*b as f64 / total as f64 - 0.5).abs() < 0.2,
                "{sharded_bytes:?} of {total}"
            );
        }
        // One rank taking both inputs: the same sums, in the same order.
        let (single, _, _) = data_parallel_steps(kind, 1, false, 3, None);
        assert_bits_equal(&single[0], &plain[0], "one rank against two");

        // Resume: 3 steps, then 2 more from the gathered state (the
        // weights after 3 steps are whole on every rank), on 2 sharded ranks
        // and on 1: the bits of 5 steps straight.
        let (five, _, _) = data_parallel_steps(kind, 2, false, 5, None);
        let start = (copies(&plain[0]), sharded_state, 3);
        for (ranks, shard) in [(2, true), (1, false)] {
            let (resumed, _, _) = data_parallel_steps(kind, ranks, shard, 2, Some(&start));
            assert_bits_equal(&resumed[0], &five[0], "resumed");
        }
    }
}
