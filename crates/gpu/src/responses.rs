//! Logits at the response positions of `prompt ++ response` rows, with each
//! distinct prompt run once: RL batches hold every prompt n times (a
//! group's samples), so the prompts are run as a batch of their own, their
//! keys and values are expanded to the rows (`index_select`, whose gradient
//! sums the rows' contributions), and only the response tokens run per row.
//! The same function as running every full row, with autograd, in fewer
//! rows: with 16-token prompts, 8 samples and 8-token answers, 640 rows
//! instead of 1,536.

use std::collections::HashMap;

use tch::{Kind, Tensor};

use crate::error::ModelError;
use crate::model::default_positions;
use crate::model::Model;

/// What [`Model::response_logits`] returns.
#[derive(Debug)]
pub struct ResponseLogits {
    /// Logits at the positions predicting each response token `[B, R, vocab]`
    /// (R = the longest response, at least 1).
    pub logits: Tensor,
    /// The response tokens `[B, R]` (padding where a response is shorter).
    pub targets: Tensor,
    /// 1.0 on real response tokens `[B, R]` (float32).
    pub mask: Tensor,
}

impl Model {
    /// Logits predicting each row's response tokens given its prompt, with
    /// every distinct prompt run once (see the module docs). Differentiable.
    pub fn response_logits(
        &self,
        prompts: &[Vec<i64>],
        responses: &[Vec<i64>],
    ) -> Result<ResponseLogits, ModelError> {
        let r = self.response_hidden(prompts, responses)?;
        Ok(ResponseLogits {
            logits: self.lm_logits(&r.logits)?,
            targets: r.targets,
            mask: r.mask,
        })
    }

    /// As [`Model::response_logits`], but the final hidden states
    /// `[B, R, hidden]` before the output head (in the `logits` field).
    pub fn response_hidden(
        &self,
        prompts: &[Vec<i64>],
        responses: &[Vec<i64>],
    ) -> Result<ResponseLogits, ModelError> {
        if prompts.len() != responses.len() || prompts.is_empty() {
            return Err(ModelError::Input(format!(
                "{} prompts for {} responses",
                prompts.len(),
                responses.len()
            )));
        }
        self.check_token_ids(prompts, responses)?;
        let device = self.device();
        let pad = self.config.pad_token_id.unwrap_or(0).max(0);
        let mut seen: HashMap<&[i64], i64> = HashMap::new();
        let mut distinct: Vec<&[i64]> = Vec::new();
        let owner: Vec<i64> = prompts
            .iter()
            .map(|p| {
                *seen.entry(p.as_slice()).or_insert_with(|| {
                    distinct.push(p);
                    distinct.len() as i64 - 1
                })
            })
            .collect();
        // The distinct prompts, left-padded.
        let width = distinct.iter().map(|p| p.len()).max().unwrap_or(1);
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        for p in &distinct {
            let padding = width - p.len();
            ids.extend(std::iter::repeat_n(pad, padding).chain(p.iter().copied()));
            mask.extend(std::iter::repeat_n(0i64, padding).chain(std::iter::repeat_n(1, p.len())));
        }
        let shape = [distinct.len() as i64, width as i64];
        let ids = Tensor::from_slice(&ids).view(shape).to_device(device);
        let prompt_mask = Tensor::from_slice(&mask).view(shape).to_device(device);
        let mut cache = self.new_cache();
        let hidden = self.forward_cached(
            &ids,
            &prompt_mask,
            &default_positions(&prompt_mask),
            &mut cache,
        );
        let rows = Tensor::from_slice(&owner).to_device(device);
        cache.select_rows(&rows);
        let last = hidden.narrow(1, width as i64 - 1, 1).index_select(0, &rows);

        let r = responses.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let b = responses.len() as i64;
        let (mut targets, mut target_mask) = (Vec::new(), Vec::new());
        for resp in responses {
            targets.extend(
                resp.iter()
                    .copied()
                    .chain(std::iter::repeat_n(pad, r - resp.len())),
            );
            target_mask.extend(
                std::iter::repeat_n(1.0f32, resp.len())
                    .chain(std::iter::repeat_n(0.0, r - resp.len())),
            );
        }
        let targets = Tensor::from_slice(&targets)
            .view([b, r as i64])
            .to_device(device);
        let target_mask = Tensor::from_slice(&target_mask)
            .view([b, r as i64])
            .to_device(device);
        let hidden = if r > 1 {
            // Response tokens 0..R−1 follow their prompt in the cache; token j
            // is a key only where it is real.
            let fed = targets.narrow(1, 0, r as i64 - 1);
            let fed_mask = target_mask.narrow(1, 0, r as i64 - 1).to_kind(Kind::Int64);
            let key_mask = Tensor::cat(&[&prompt_mask.index_select(0, &rows), &fed_mask], 1);
            let lengths: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
            let positions = Tensor::from_slice(&lengths).to_device(device).view([b, 1])
                + Tensor::arange(r as i64 - 1, (Kind::Int64, device)).view([1, -1]);
            let rest = self.forward_cached(&fed, &key_mask, &positions, &mut cache);
            Tensor::cat(&[&last, &rest], 1)
        } else {
            last
        };
        Ok(ResponseLogits {
            logits: hidden,
            targets,
            mask: target_mask,
        })
    }
}
