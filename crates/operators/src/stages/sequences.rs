//! Prompt + response rows packed for one forward pass.

use tch::Tensor;

/// Right-padded `prompt ++ response` rows, and for each response token `j`
/// of row `i` the position `len(prompt_i) − 1 + j` that predicts it — the
/// index into token log-probs (entry `t − 1` is `log p(token t | < t)`) and
/// into per-position critic values alike.
pub struct Packed {
    /// Token ids `[B, T]`.
    pub ids: Tensor,
    /// Attention mask `[B, T]`.
    pub mask: Tensor,
    /// Predicting positions `[B, R]` (R = the longest response; padded entries repeat the last).
    pub index: Tensor,
    /// 1.0 on real response tokens `[B, R]`.
    pub response_mask: Tensor,
}

/// Packs `prompts[i] ++ responses[i]`, padding with `pad`, on `device`.
pub fn pack(prompts: &[Vec<i64>], responses: &[Vec<i64>], pad: i64, device: tch::Device) -> Packed {
    let width = prompts
        .iter()
        .zip(responses)
        // An empty response still gets one (padded) slot to be read at.
        .map(|(p, r)| p.len() + r.len().max(1))
        .max()
        .unwrap_or(1);
    let r_max = responses.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let (mut ids, mut mask, mut index, mut rmask) = (vec![], vec![], vec![], vec![]);
    for (p, r) in prompts.iter().zip(responses) {
        let len = p.len() + r.len();
        ids.extend(
            p.iter()
                .chain(r)
                .copied()
                .chain(std::iter::repeat_n(pad, width - len)),
        );
        mask.extend(std::iter::repeat_n(1i64, len).chain(std::iter::repeat_n(0, width - len)));
        for j in 0..r_max {
            index.push((p.len() + j.min(r.len().saturating_sub(1))) as i64 - 1);
            rmask.push(if j < r.len() { 1.0f32 } else { 0.0 });
        }
    }
    let (b, w, r) = (prompts.len() as i64, width as i64, r_max as i64);
    Packed {
        ids: Tensor::from_slice(&ids).view([b, w]).to_device(device),
        mask: Tensor::from_slice(&mask).view([b, w]).to_device(device),
        index: Tensor::from_slice(&index).view([b, r]).to_device(device),
        response_mask: Tensor::from_slice(&rmask).view([b, r]).to_device(device),
    }
}

/// Each row's `column` text tokenised (no special tokens) with the
/// tokenizer's first eos id appended: the targets of SFT and preference pairs.
pub fn response_targets(
    batch: &arrow::array::RecordBatch,
    column: &str,
    tokenizer: &weir_gpu::Tokenizer,
    stage: &str,
) -> Result<Vec<Vec<i64>>, weir_graph::StageError> {
    let eos = *tokenizer.eos_token_ids().first().ok_or_else(|| {
        format!(
            "{}: the tokenizer has no eos token to end responses with",
            tokenizer.dir().display()
        )
    })?;
    super::columns::strings(batch, column, stage)?
        .iter()
        .map(|t| {
            let mut ids = tokenizer.encode(t, false)?;
            ids.push(eos);
            Ok(ids)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_points_at_the_predicting_positions() {
        let p = pack(
            &[vec![1, 2, 3], vec![4]],
            &[vec![9, 8], vec![7, 6, 5]],
            0,
            tch::Device::Cpu,
        );
        assert_eq!(
            Vec::<i64>::try_from(p.ids.flatten(0, -1)).unwrap(),
            vec![1, 2, 3, 9, 8, 4, 7, 6, 5, 0]
        );
        assert_eq!(
            Vec::<i64>::try_from(p.index.flatten(0, -1)).unwrap(),
            vec![2, 3, 3, 0, 1, 2]
        );
        assert_eq!(
            Vec::<f32>::try_from(p.response_mask.flatten(0, -1)).unwrap(),
            vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
        );
    }
}
