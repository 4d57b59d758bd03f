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
