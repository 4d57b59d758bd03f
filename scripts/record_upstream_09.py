"""Records the upstream outputs weir's RL math is held to by
`crates/operators/tests/upstream.rs` (the file `upstream_09_cases.json`):
verl 0.9.1 and OpenRLHF 0.11.2 as released on PyPI.

Nothing of either project is kept in this repository: the script downloads
their wheels (`pip download --no-deps`), imports the functions from them,
runs them with torch in float64 on seeded random inputs, and writes the
inputs and outputs. OpenRLHF's modules import GPU-only packages at module
level (flash_attn, deepspeed, vllm); those are replaced by empty stubs,
which the recorded functions never touch.

    python3 -m venv /tmp/rec && /tmp/rec/bin/pip install torch numpy packaging \
        ray tensordict omegaconf transformers codetiming orjson peft pylatexenc aiohttp torchdata
    /tmp/rec/bin/python scripts/record_upstream_09.py [WORK_DIR]
"""

import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import types
import zipfile

VERL, OPENRLHF = "0.9.1", "0.11.2"
work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/weir-upstream"
out_path = os.path.join(os.path.dirname(__file__), "../crates/operators/tests/data/upstream_09_cases.json")


def wheel(package, version):
    dest = os.path.join(work, f"{package}-{version}")
    if not os.path.isdir(dest):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{package}=={version}", "-d", work],
            check=True,
        )
        name = next(f for f in os.listdir(work) if f.startswith(f"{package}-{version}") and f.endswith(".whl"))
        zipfile.ZipFile(os.path.join(work, name)).extractall(dest)
    purelib = os.path.join(dest, f"{package}-{version}.data", "purelib")
    return purelib if os.path.isdir(purelib) else dest


class _Any(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any(f"{self.__name__}.{name}")

    def __call__(self, *a, **k):
        return None


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    roots = ("flash_attn", "deepspeed", "vllm", "ring_flash_attn", "liger_kernel", "bitsandbytes",
             "datasets", "PIL", "pandas")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Any(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Stubs())
sys.path[:0] = [wheel("verl", VERL), wheel("openrlhf", OPENRLHF)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_default_dtype(torch.float64)
import verl.trainer.ppo.core_algos as verl_algos  # noqa: E402
from openrlhf.models import loss as orl_loss  # noqa: E402
from openrlhf.models import utils as orl_utils  # noqa: E402

rng = np.random.default_rng(20261201)
cases = []


def mat(rows, cols, scale=1.0):
    return (rng.standard_normal((rows, cols)) * scale).tolist()


def mask(rows, cols, gaps=False):
    m = np.zeros((rows, cols))
    for r in range(rows):
        n = int(rng.integers(1, cols + 1))
        m[r, :n] = 1.0
        if gaps and n > 3:
            a = int(rng.integers(1, n - 1))
            m[r, a : a + int(rng.integers(1, n - a))] = 0.0
            m[r, n - 1] = 1.0
    return m.tolist()


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def add(name, kind, flavor, source, inputs, expected):
    cases.append(dict(name=name, kind=kind, flavor=flavor, source=source, inputs=inputs, expected=expected))


class Cfg(dict):
    """A stand-in for verl's config objects: attributes and `.get`."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError as e:
            raise AttributeError(k) from e


# ---- verl advantages -------------------------------------------------------
verl_src = f"verl=={VERL} verl/trainer/ppo/core_algos.py"
for n in range(4):
    B, T = 8, 7
    index = [int(i) for i in rng.integers(0, 3, size=B)]
    m = mask(B, T, gaps=(n % 2 == 1))
    scores = rng.integers(0, 3, size=B).astype(float) * 0.5 + rng.standard_normal(B) * (n % 2)
    tlr = np.zeros((B, T))
    for r in range(B):
        last = max(i for i in range(T) if m[r][i] > 0)
        tlr[r, last] = scores[r]
        if n >= 2:
            tlr[r] += np.array(m[r]) * rng.standard_normal(T) * 0.1
    tlr = tlr.tolist()
    common = dict(token_level_rewards=tlr, mask=m, index=index)
    for est in ["remax", "opo", "grpo_passk", "gpg", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "grpo"]:
        fn = verl_algos.get_adv_estimator_fn(est)
        kw = dict(token_level_rewards=t(tlr), response_mask=t(m), index=np.array(index))
        inputs = dict(common, estimator=est)
        if est == "remax":
            baselines = (rng.standard_normal(B)).tolist()
            kw["reward_baselines"] = t(baselines)
            inputs["reward_baselines"] = baselines
        if est == "reinforce_plus_plus":
            gamma = [1.0, 0.9][n % 2]
            kw["config"] = Cfg(gamma=gamma)
            inputs["gamma"] = gamma
        if est in ("grpo", "grpo_passk"):
            norm = n % 2 == 0
            kw["norm_adv_by_std_in_grpo"] = norm
            kw["config"] = Cfg(norm_adv_by_std_in_grpo=norm)
            inputs["norm_adv_by_std_in_grpo"] = norm
        if est == "grpo_passk" and min(index.count(g) for g in set(index)) < 2:
            continue
        if est in ("rloo", "grpo", "opo", "reinforce_plus_plus_baseline", "gpg") and "config" not in kw:
            kw["config"] = Cfg()
        a, r = fn(**kw)
        add(f"verl09_{est}_{n}", "advantages_verl_09", "verl", f"{verl_src} ({fn.__name__})", inputs,
            dict(advantages=a.tolist(), returns=r.tolist()))

# ---- verl KL estimators, values and gradients --------------------------------
for n, est in enumerate(["k1", "k2", "k3", "abs", "mse", "low_var_kl", "k1+", "k3+"]):
    lp, rp = mat(3, 5, 0.7), mat(3, 5, 0.7)
    x = t(lp).requires_grad_(True)
    kl = verl_algos.kl_penalty(x, t(rp), est)
    kl.sum().backward()
    add(f"verl09_kl_{est}", "kl_09", "verl", f"{verl_src} (kl_penalty)",
        dict(estimator=est, logprobs=lp, ref_logprobs=rp),
        dict(kl=kl.detach().tolist(), grad=x.grad.tolist()))

# ---- verl policy losses, values and gradients -------------------------------------
# GSPO and SAPO check `isinstance(config, ActorConfig)`: the stand-in passes.
verl_algos.ActorConfig = Cfg
modes = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
losses = [("vanilla", {}), ("vanilla", dict(clip_ratio_high=0.28, clip_ratio_c=3.0)), ("vanilla", dict(clip_ratio_c=1.5)),
          ("gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4)), ("sapo", dict(tau_pos=1.0, tau_neg=1.05)),
          ("gpg", {}), ("cispo", dict(clip_ratio_low=0.2, clip_ratio_high=0.28)), ("geo_mean", dict(clip_ratio_low=0.4, clip_ratio_high=0.4))]
for n, (loss_name, extra) in enumerate(losses):
    for m_i, mode in enumerate(modes):
        if loss_name in ("sapo", "geo_mean") and m_i > 0:
            continue  # these ignore the mode
        B, T = 4, 6
        m = mask(B, T)
        old = mat(B, T, 0.5)
        lp = (np.array(old) + rng.standard_normal((B, T)) * 0.3).tolist()
        # Per-token advantages (GAE-like), so GSPO's token handling shows.
        adv = mat(B, T)
        scale = None if mode != "seq-mean-token-sum-norm" else [None, 16.0][n % 2]
        cfg = Cfg(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                  global_batch_info=dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=scale))
        cfg.update(extra)
        x = t(lp).requires_grad_(True)
        fn = verl_algos.get_policy_loss_fn(loss_name)
        loss, metrics = fn(old_log_prob=t(old), log_prob=x, advantages=t(adv), response_mask=t(m), loss_agg_mode=mode, config=cfg)
        loss.backward()
        add(f"verl09_pg_{loss_name}_{n}_{mode}", "policy_loss_09", "verl", f"{verl_src} ({fn.__name__})",
            dict(policy_loss=loss_name, mode=mode, loss_scale_factor=scale, logprobs=lp, old_logprobs=old, advantages=adv, mask=m,
                 clip_low=cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio,
                 clip_high=cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio,
                 dual_clip=cfg.clip_ratio_c, tau_pos=cfg.get("tau_pos"), tau_neg=cfg.get("tau_neg")),
            dict(loss=loss.item(), grad=x.grad.tolist(), clip_fraction=metrics.get("actor/pg_clipfrac"), approx_kl=metrics.get("actor/ppo_kl")))

# KL-Cov (its tokens by top-k covariance) and REINFORCE with verl's bypass-mode weights.
for n in range(3):
    B, T = 4, 6
    m = mask(B, T)
    old = mat(B, T, 0.5)
    lp = (np.array(old) + rng.standard_normal((B, T)) * 0.3).tolist()
    adv = mat(B, T)
    mode = modes[n]
    base = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                global_batch_info=dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None))
    x = t(lp).requires_grad_(True)
    cfg = Cfg(base, policy_loss=Cfg(kl_cov_ratio=[0.1, 0.25, 0.05][n], ppo_kl_coef=[0.1, 1.0, 0.5][n]))
    fn = verl_algos.get_policy_loss_fn("kl_cov")
    loss, metrics = fn(old_log_prob=t(old), log_prob=x, advantages=t(adv), response_mask=t(m), loss_agg_mode=mode, config=cfg)
    loss.backward()
    add(f"verl09_pg_kl_cov_{n}", "policy_loss_09", "verl", f"{verl_src} ({fn.__name__})",
        dict(policy_loss="kl_cov", mode=mode, loss_scale_factor=None, logprobs=lp, old_logprobs=old, advantages=adv, mask=m,
             clip_low=0.2, clip_high=0.2, dual_clip=3.0, kl_cov_ratio=cfg.policy_loss.kl_cov_ratio, kl_cov_coef=cfg.policy_loss.ppo_kl_coef),
        dict(loss=loss.item(), grad=x.grad.tolist(), clip_fraction=None, approx_kl=None))
    # REINFORCE in bypass mode: the old policy is the rollout's, the weight its truncated ratio.
    x = t(lp).requires_grad_(True)
    cap = [2.0, 1.2, 5.0][n]
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights  # noqa: E402
    w, _ = compute_rollout_correction_weights((x - t(old)).detach(), t(m), rollout_is="token", rollout_is_threshold=str(cap))
    loss, metrics = verl_algos.compute_policy_loss_reinforce(t(old), x, t(adv), t(m), loss_agg_mode=mode, config=Cfg(base), rollout_is_weights=w)
    loss.backward()
    add(f"verl09_pg_reinforce_{n}", "policy_loss_09", "verl",
        f"{verl_src} (compute_policy_loss_reinforce with rollout_corr_helper.compute_rollout_correction_weights, bypass mode)",
        dict(policy_loss="reinforce", mode=mode, loss_scale_factor=None, logprobs=lp, old_logprobs=old, advantages=adv, mask=m,
             clip_low=0.2, clip_high=0.2, dual_clip=3.0, cap=cap),
        dict(loss=loss.item(), grad=x.grad.tolist(), clip_fraction=None, approx_kl=metrics["actor/ppo_kl"]))

# ---- verl rollout corrections: IS weights and rejection masks ------------------------
from verl.trainer.ppo import rollout_corr_helper as corr  # noqa: E402

corr_src = f"verl=={VERL} verl/trainer/ppo/rollout_corr_helper.py"
specs = [("tis", "token", "2.0"), ("icepop", "token", "0.5_2.0"), ("seq-tis", "sequence", "3.0"),
         ("geo-rejection", "seq_mean_k1", "0.8_1.25"), ("k3-rejection", "seq_mean_k3", "0.05")]
for n in range(2):
    for name, level, threshold in specs:
        B, T = 6, 8
        m = mask(B, T)
        behaviour = mat(B, T, 0.8)
        old = (np.array(behaviour) + rng.standard_normal((B, T)) * [0.2, 0.6][n]).tolist()
        log_ratio = t(old) - t(behaviour)
        if name in ("tis", "icepop", "seq-tis"):
            w, _ = corr.compute_rollout_correction_weights(log_ratio, t(m), rollout_is=level, rollout_is_threshold=threshold)
            fn = "compute_rollout_correction_weights"
        else:
            w, _ = corr.compute_rollout_rejection_mask(log_ratio, t(m), rollout_rs=level, rollout_rs_threshold=threshold)
            fn = "compute_rollout_rejection_mask"
        add(f"verl09_correction_{name}_{n}", "correction_09", "verl", f"{corr_src} ({fn})",
            dict(correction=name, threshold=threshold, old_logprobs=old, behaviour_logprobs=behaviour, mask=m),
            dict(weights=(w * t(m)).tolist()))

# ---- OpenRLHF policy loss, values and gradients ------------------------------------
orl_loss_src = f"openrlhf=={OPENRLHF} openrlhf/models/loss.py (PolicyLoss)"
settings = [
    dict(policy_loss_type="ppo", token_level_loss=True),
    dict(policy_loss_type="ppo", token_level_loss=False, clip_eps_high=0.28),
    dict(policy_loss_type="ppo", token_level_loss=True, dual_clip=3.0),
    dict(policy_loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4),
    dict(policy_loss_type="ppo", is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.5, 2.0)),
    dict(policy_loss_type="ppo", is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.5, 2.0)),
    dict(policy_loss_type="ppo", token_level_loss=False, is_correction_level="seq", is_correction_mode="mask", is_correction_threshold=(0.8, 1.25)),
]
names = {("token", "clip"): "tis", ("token", "mask"): "icepop", ("seq", "mask"): "seq-mask-tis"}
for n, kw in enumerate(settings):
    B, T = 5, 7
    m = mask(B, T)
    behaviour = mat(B, T, 0.6)
    old = (np.array(behaviour) + rng.standard_normal((B, T)) * 0.3).tolist()
    lp = (np.array(old) + rng.standard_normal((B, T)) * 0.3).tolist()
    adv = mat(B, T)
    x = t(lp).requires_grad_(True)
    fn = orl_loss.PolicyLoss(**kw)
    correction = kw.get("is_correction_level", "off")
    loss, clip_ratio, ppo_kl, _, _ = fn(x, t(old), t(adv), action_mask=t(m),
                                        rollout_log_probs=t(behaviour) if correction != "off" else None)
    loss.backward()
    add(f"openrlhf011_pg_{n}", "policy_loss", "openrlhf", orl_loss_src,
        dict(policy_loss_type=kw["policy_loss_type"], token_level_loss=fn.token_level_loss,
             clip_low=kw.get("clip_eps_low", 0.2), clip_high=kw.get("clip_eps_high", 0.2), dual_clip=kw.get("dual_clip"),
             correction=None if correction == "off" else names[(correction, kw["is_correction_mode"])],
             threshold=list(kw.get("is_correction_threshold", (0.5, 5.0))),
             logprobs=lp, old_logprobs=old, behaviour_logprobs=behaviour if correction != "off" else None,
             advantages=adv, mask=m),
        dict(loss=loss.item(), grad=x.grad.tolist(), clip_fraction=clip_ratio.item(), approx_kl=ppo_kl.item()))

# ---- OpenRLHF advantages: RemoteExperienceMaker.compute_advantages_and_returns itself --
from openrlhf.trainer.ppo_utils import experience_maker as orl_exp  # noqa: E402

NS = types.SimpleNamespace
for n, est in enumerate(["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "gae", "reinforce"]):
    k = 1 if est in ("gae", "reinforce") and n < 6 else 4
    B, T = 8, 6
    m = mask(B, T)
    scores = (rng.standard_normal(B) * 2).tolist()
    kl = mat(B, T, 0.05)
    values = mat(B, T, 0.5)
    gamma, lambd = [1.0, 0.9][n % 2], 0.95
    no_std_norm = n == 6
    clip = [-1.5, 1.5] if n >= 6 else None
    kl_coef = 0.05
    args = NS(rollout=NS(n_samples_per_prompt=k, max_new_tokens=T),
              algo=NS(advantage=NS(estimator=est, gamma=gamma, lambd=lambd, no_std_norm=no_std_norm)),
              reward=NS(clip_range=clip, overlong_buffer_len=None, stop_properly_penalty_coef=None), data=NS(max_len=T))
    maker = orl_exp.RemoteExperienceMaker.__new__(orl_exp.RemoteExperienceMaker)
    maker.strategy, maker.args, maker.advantage_estimator, maker.kl_ctl = NS(args=args), args, est, NS(value=kl_coef)
    # Two experiences of four samples, as the trainer splits a batch.
    exps = [NS(rewards=t(scores[j:j + 4]), index=list(range(j, j + 4)), kl=t(kl[j:j + 4]), action_mask=t(m[j:j + 4]),
               values=t(values[j:j + 4]), info={}, response_length=t(m[j:j + 4]).sum(-1)) for j in (0, 4)]
    exps = maker.compute_advantages_and_returns(exps)
    add(f"openrlhf011_advantages_{est}_{n}", "advantages_openrlhf", "openrlhf",
        f"openrlhf=={OPENRLHF} openrlhf/trainer/ppo_utils/experience_maker.py (RemoteExperienceMaker.compute_advantages_and_returns, estimator={est!r})",
        dict(estimator=est, n_samples_per_prompt=k, gamma=gamma, lambd=lambd, no_std_norm=no_std_norm, clip=clip, kl_coef=kl_coef,
             scores=scores, kl=kl, mask=m, values=values),
        dict(advantages=torch.cat([e.advantages for e in exps]).tolist(), returns=torch.cat([e.returns for e in exps]).tolist()))

# ---- OpenRLHF KL estimators ------------------------------------------------------
orl_src = f"openrlhf=={OPENRLHF} openrlhf/models/utils.py"
for est in ["k1", "k2", "k3"]:
    lp, rp = mat(3, 5, 0.7), mat(3, 5, 0.7)
    x = t(lp).requires_grad_(True)
    kl = orl_utils.compute_approx_kl(x, t(rp), kl_estimator=est)
    kl.sum().backward()
    add(f"openrlhf011_kl_{est}", "kl_09", "openrlhf", f"{orl_src} (compute_approx_kl)",
        dict(estimator=est, logprobs=lp, ref_logprobs=rp),
        dict(kl=kl.detach().tolist(), grad=x.grad.tolist()))

# ---- OpenRLHF pairwise reward-model loss with a margin ------------------------------
for n in range(3):
    chosen, rejected = rng.standard_normal(6).tolist(), rng.standard_normal(6).tolist()
    margin = None if n == 0 else (rng.random(6) * 2).tolist()
    loss = orl_loss.PairWiseLoss()(t(chosen), t(rejected), None if margin is None else t(margin))
    add(f"openrlhf011_pairwise_{n}", "pairwise_09", "openrlhf", f"openrlhf=={OPENRLHF} openrlhf/models/loss.py (PairWiseLoss)",
        dict(chosen=chosen, rejected=rejected, margin=margin), dict(loss=loss.item()))

# ---- verl rejection bands whose bounds are not reciprocal ---------------------------
# seq_mean_k1 compares the mean K1 (−log ρ) with [ln low, ln high]: on the
# geometric-mean ratio that is [1/high, 1/low], which only a band with
# low · high = 1 (as the cases above) cannot tell from [low, high]. A seed of
# its own, so the cases above keep their inputs.
band_rng = np.random.default_rng(20261203)
for n, threshold in enumerate(["0.9_1.1", "0.5_1.05", "0.95_3.0"]):
    B, T = 8, 6
    m = np.zeros((B, T))
    for r in range(B):
        m[r, : int(band_rng.integers(1, T + 1))] = 1.0
    m = m.tolist()
    behaviour = (band_rng.standard_normal((B, T)) * 0.8).tolist()
    # Per response, a shift of the log-ratio spread over both sides of 0.
    shift = band_rng.uniform(-0.3, 0.3, size=(B, 1))
    old = (np.array(behaviour) + shift + band_rng.standard_normal((B, T)) * 0.05).tolist()
    w, _ = corr.compute_rollout_rejection_mask(t(old) - t(behaviour), t(m), rollout_rs="seq_mean_k1", rollout_rs_threshold=threshold)
    add(f"verl09_correction_geo-rejection_band_{n}", "correction_09", "verl", f"{corr_src} (compute_rollout_rejection_mask)",
        dict(correction="geo-rejection", threshold=threshold, old_logprobs=old, behaviour_logprobs=behaviour, mask=m),
        dict(weights=(w * t(m)).tolist()))

# ---- verl rejection statistics and chains, sequence IcePop; OpenRLHF's divergence --
# gates and unbiased KL gradient. A seed of its own, so the cases above keep their inputs.
off_rng = np.random.default_rng(20261205)


def off_policy(B, T, spread=0.3):
    m = np.zeros((B, T))
    for r in range(B):
        m[r, : int(off_rng.integers(1, T + 1))] = 1.0
    # Log-probabilities (≤ 0), the proximal ones a per-response shift and a
    # per-token spread away from the behaviour's.
    behaviour = -np.abs(off_rng.standard_normal((B, T)) * 1.2)
    shift = off_rng.uniform(-spread, spread, size=(B, 1))
    old = np.minimum(behaviour + shift + off_rng.standard_normal((B, T)) * spread, 0.0)
    return m.tolist(), behaviour.tolist(), old.tolist()


rejections = [
    ("token_k1", "0.7_1.4"), ("token_k2", "0.05"), ("token_k3", "0.05"),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", "0.2"), ("seq_sum_k3", "0.2"),
    ("seq_mean_k2", "0.04"), ("seq_max_k2", "0.1"), ("seq_max_k3", "0.1"),
    ("token_k1,seq_mean_k3", "0.5_2.0,0.1"), ("token_k2,seq_max_k3,seq_sum_k1", "0.08,0.15,0.6_1.8"),
    ("seq_mean_k1", "1.25"),
]
for n, (options, threshold) in enumerate(rejections):
    m, behaviour, old = off_policy(8, 7)
    w, _ = corr.compute_rollout_rejection_mask(t(old) - t(behaviour), t(m), rollout_rs=options, rollout_rs_threshold=threshold)
    add(f"verl09_rejection_{n}", "rejection_09", "verl", f"{corr_src} (compute_rollout_rejection_mask)",
        dict(options=options, threshold=threshold, old_logprobs=old, behaviour_logprobs=behaviour, mask=m),
        dict(mask=w.tolist()))

for n, threshold in enumerate(["0.5_2.0", "0.8_1.5"]):
    m, behaviour, old = off_policy(8, 5, spread=0.15)
    w, _ = corr.compute_rollout_correction_weights(t(old) - t(behaviour), t(m), rollout_is="sequence", rollout_is_threshold=threshold)
    add(f"verl09_correction_seq-icepop_{n}", "correction_09", "verl", f"{corr_src} (compute_rollout_correction_weights)",
        dict(correction="seq-icepop", threshold=threshold, old_logprobs=old, behaviour_logprobs=behaviour, mask=m),
        dict(weights=(w * t(m)).tolist()))

gates = [("token", "binary_kl", 0.02), ("seq", "binary_kl", 0.06), ("token", "tv", 0.08), ("seq", "tv", 0.05)]
for n, (level, gating, delta) in enumerate(gates):
    B, T = 6, 7
    m, behaviour, old = off_policy(B, T)
    lp = (np.array(old) + off_rng.standard_normal((B, T)) * 0.2).tolist()
    adv = (off_rng.standard_normal((B, T))).tolist()
    x = t(lp).requires_grad_(True)
    fn = orl_loss.PolicyLoss(is_correction_level=level, is_correction_mode="mask", is_correction_gating=gating,
                             is_correction_threshold=[0, delta], token_level_loss=level == "token")
    loss, clip_ratio, ppo_kl, _, _ = fn(x, t(old), t(adv), action_mask=t(m), rollout_log_probs=t(behaviour))
    loss.backward()
    name = ("seq-" if level == "seq" else "") + gating.replace("_", "-")
    add(f"openrlhf011_pg_gate_{n}", "policy_loss", "openrlhf", orl_loss_src,
        dict(policy_loss_type="ppo", token_level_loss=fn.token_level_loss, clip_low=0.2, clip_high=0.2, dual_clip=None,
             correction=name, threshold=[0.0, delta], logprobs=lp, old_logprobs=old, behaviour_logprobs=behaviour,
             advantages=adv, mask=m),
        dict(loss=loss.item(), grad=x.grad.tolist(), clip_fraction=clip_ratio.item(), approx_kl=ppo_kl.item()))

for n, est in enumerate(["k1", "k2", "k3", "k3"]):
    B, T = 5, 6
    m, base, old = off_policy(B, T)
    lp = (np.array(old) + off_rng.standard_normal((B, T)) * (0.2 if n < 3 else 1.5)).tolist()
    x = t(lp).requires_grad_(True)
    kl = orl_utils.compute_approx_kl(x, t(base), log_probs_old=t(old), kl_estimator=est, unbiased_gradient=True)
    (kl * t(m)).sum().backward()
    add(f"openrlhf011_kl_unbiased_{n}", "kl_unbiased", "openrlhf", f"openrlhf=={OPENRLHF} openrlhf/models/utils.py (compute_approx_kl, unbiased_gradient=True)",
        dict(estimator=est, logprobs=lp, ref_logprobs=base, old_logprobs=old, mask=m),
        dict(kl=kl.detach().tolist(), grad=x.grad.tolist()))

# verl's batch-normalised importance weights (rollout_is_batch_normalize), token and sequence level.
for n, (level, threshold) in enumerate([("token", "2.0"), ("token", "0.5_2.0"), ("sequence", "5.0"), ("sequence", "0.5_3.0")]):
    m, behaviour, old = off_policy(8, 6, spread=0.2)
    w, metrics = corr.compute_rollout_correction_weights(t(old) - t(behaviour), t(m), rollout_is=level,
                                                         rollout_is_threshold=threshold, rollout_is_batch_normalize=True)
    name = {("token", False): "tis", ("token", True): "icepop", ("sequence", False): "seq-tis", ("sequence", True): "seq-icepop"}[(level, "_" in threshold)]
    add(f"verl09_correction_{name}_batch_normalized_{n}", "correction_09", "verl", f"{corr_src} (compute_rollout_correction_weights, rollout_is_batch_normalize=True)",
        dict(correction=name, threshold=threshold, batch_normalize=True, old_logprobs=old, behaviour_logprobs=behaviour, mask=m),
        dict(weights=(w * t(m)).tolist(), normalizer=metrics["rollout_is_batch_norm_factor"]))

# ---- OpenRLHF ProRL stop-properly penalty: apply_stop_properly_penalty itself ------
from openrlhf.trainer.ppo_utils import length_penalty as orl_length  # noqa: E402

for n, coef in enumerate([0.0, 0.5, 1.0, -0.5, -1.0]):
    rewards = (rng.standard_normal(6) * 2).tolist()
    truncated = [bool(x) for x in rng.integers(0, 2, 6)]
    exp = NS(rewards=t(rewards), truncated=torch.tensor(truncated))
    orl_length.apply_stop_properly_penalty([exp], coef)
    add(f"openrlhf011_stop_properly_{n}", "stop_properly", "openrlhf",
        f"openrlhf=={OPENRLHF} openrlhf/trainer/ppo_utils/length_penalty.py (apply_stop_properly_penalty)",
        dict(coef=coef, rewards=rewards, truncated=truncated),
        dict(rewards=exp.rewards.tolist()))

# ---- verl DPPO (trust region on the sampled token's probability), values and gradients ------
# Real log-probabilities (the binary KL needs π < 1), moved enough that some tokens leave the region.
dppo = [("dppo_tv", 0.05, 0.08, 3.0), ("dppo_tv", 0.1, 0.1, 1.5), ("dppo_kl", 0.01, 0.02, 3.0), ("dppo_kl", 0.05, 0.05, 20.0)]
for n, (loss_name, low, high, cap) in enumerate(dppo):
    for mode in modes:
        B, T = 4, 6
        m = mask(B, T)
        old = (-np.abs(rng.standard_normal((B, T))) * 1.5 - 0.02).tolist()
        lp = np.minimum(np.array(old) + rng.standard_normal((B, T)) * 0.4, -1e-3).tolist()
        adv = mat(B, T)
        scale = None if mode != "seq-mean-token-sum-norm" else 16.0
        cfg = Cfg(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cap,
                  global_batch_info=dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=scale))
        x = t(lp).requires_grad_(True)
        fn = verl_algos.get_policy_loss_fn(loss_name)
        loss, metrics = fn(old_log_prob=t(old), log_prob=x, advantages=t(adv), response_mask=t(m), loss_agg_mode=mode, config=cfg)
        loss.backward()
        add(f"verl09_pg_{loss_name}_{n}_{mode}", "policy_loss_09", "verl", f"{verl_src} ({fn.__name__})",
            dict(policy_loss=loss_name, mode=mode, loss_scale_factor=scale, logprobs=lp, old_logprobs=old, advantages=adv, mask=m,
                 clip_low=low, clip_high=high, dual_clip=cap),
            dict(loss=loss.item(), grad=x.grad.tolist(), clip_fraction=metrics["actor/pg_clipfrac"], approx_kl=metrics["actor/ppo_kl"]))

# ---- verl DRO (a quadratic log-ratio penalty), values and gradients ------
for n, beta in enumerate([0.05, 0.5]):
    for mode in modes:
        B, T = 4, 6
        m = mask(B, T)
        old = mat(B, T, 0.5)
        lp = (np.array(old) + rng.standard_normal((B, T)) * 0.3).tolist()
        adv = mat(B, T)
        scale = None if mode != "seq-mean-token-sum-norm" else 16.0
        cfg = Cfg(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, policy_loss=Cfg(dro_beta=beta),
                  global_batch_info=dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=scale))
        x = t(lp).requires_grad_(True)
        fn = verl_algos.get_policy_loss_fn("dro")
        loss, metrics = fn(old_log_prob=t(old), log_prob=x, advantages=t(adv), response_mask=t(m), loss_agg_mode=mode, config=cfg)
        loss.backward()
        add(f"verl09_pg_dro_{n}_{mode}", "policy_loss_09", "verl", f"{verl_src} ({fn.__name__})",
            dict(policy_loss="dro", mode=mode, loss_scale_factor=scale, logprobs=lp, old_logprobs=old, advantages=adv, mask=m,
                 clip_low=0.2, clip_high=0.2, dual_clip=3.0, dro_beta=beta),
            dict(loss=loss.item(), grad=x.grad.tolist(), clip_fraction=None, approx_kl=metrics["actor/ppo_kl"]))

# ---- verl GDPO: each reward dimension group-normalised on its own, summed, whitened ------
# verl reads the dimensions from compute_score's dict (non_tensor_batch) and casts them to
# float32; the module's float32 is float64 here so that the record is float64 like the rest.
class _Float64(types.SimpleNamespace):
    pass


_np64 = _Float64(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
_np64.float32 = np.float64
_torch64 = _Float64(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
_torch64.float32 = torch.float64
_saved = (verl_algos.np, verl_algos.torch)
verl_algos.np, verl_algos.torch = _np64, _torch64
for n in range(6):
    B, T, P = 10, 6, 3
    m = mask(B, T)
    index = [int(i) for i in rng.integers(0, 3, size=B)]
    dims = 2 + n % 2
    keys = [f"r{k}" for k in range(dims)]
    # Typical terms: 0/1 correctness, a format bonus, a continuous penalty.
    comps = {k: (rng.integers(0, 2, size=B).astype(float) if j < 2 else -rng.random(B)).tolist() for j, k in enumerate(keys)}
    weights = None if n < 2 else [float(w) for w in rng.uniform(0.2, 2.0, size=dims)]
    norm = n % 3 != 2
    attention = np.concatenate([np.ones((B, P)), np.array(m)], axis=1)
    cfg = Cfg(gdpo_reward_keys=keys, gdpo_reward_weights=weights, norm_adv_by_std_in_grpo=norm)
    a, _ = verl_algos.compute_gdpo_outcome_advantage(
        token_level_rewards=t(np.zeros((B, T))), response_mask=t(m), index=np.array(index),
        norm_adv_by_std_in_grpo=norm, config=cfg, non_tensor_batch={k: np.array(v) for k, v in comps.items()},
        batch=dict(prompts=torch.zeros((B, P), dtype=torch.long), attention_mask=torch.tensor(attention, dtype=torch.long)))
    add(f"verl09_gdpo_{n}", "gdpo_09", "verl", f"{verl_src} (compute_gdpo_outcome_advantage)",
        dict(terms=[[comps[k][i] for k in keys] for i in range(B)], weights=weights or [1.0] * dims, index=index, mask=m,
             norm_adv_by_std_in_grpo=norm),
        dict(advantages=a.tolist()))
verl_algos.np, verl_algos.torch = _saved

# ---- verl optimal token baseline, single-turn and multi-turn (tool output masked) ------
for n in range(6):
    multi = n >= 3
    B, T = 9, 8
    m = mask(B, T, gaps=multi)
    index = [int(i) for i in rng.integers(0, 3, size=B)]
    if n == 1:
        index[0] = 7  # a group of one
    old = (-np.abs(rng.standard_normal((B, T))) * 1.2 - 0.01)
    # Σπ² lies between the sampled token's π² and 1.
    pi = np.exp(old)
    sq = (pi ** 2 + rng.random((B, T)) * (1 - pi ** 2) * 0.5)
    scores = (rng.integers(0, 2, size=B).astype(float) + rng.standard_normal(B) * 0.1 * (n % 2)).tolist()
    tlr = np.zeros((B, T))
    for r in range(B):
        last = max(i for i in range(T) if m[r][i] > 0)
        tlr[r, last] = scores[r]
    fn = (verl_algos.compute_multi_turn_optimal_token_baseline_advantage if multi
          else verl_algos.compute_optimal_token_baseline_advantage)
    a, _ = fn(token_level_rewards=t(tlr), response_mask=t(m), index=np.array(index), old_log_probs=t(old),
              sum_pi_squared=t(sq), handle_zero_tail=True)
    add(f"verl09_otb_{'multi' if multi else 'single'}_{n}", "otb_09", "verl", f"{verl_src} ({fn.__name__})",
        dict(rewards=scores, index=index, mask=m, logprobs=old.tolist(), sum_pi_squared=sq.tolist()),
        dict(advantages=a.tolist()))

# ---- verl top-k forward-KL distillation (teacher's top k, student's whole distribution) ------
import verl.trainer.distillation.fsdp.losses as verl_kd  # noqa: E402
from types import SimpleNamespace  # noqa: E402

kd_src = f"verl=={VERL} verl/trainer/distillation/fsdp/losses.py"
kd_config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=None, use_chunked_topk=False))
for n, k in enumerate([1, 3, 5, 11, 3]):
    T, V = 6, 11
    teacher_logits = torch.tensor(rng.standard_normal((T, V)) * 1.5)
    # The last case's student is the teacher sharpened: it holds more of the
    # support than the teacher does, and the partial sums fall below 0.
    student_logits = teacher_logits * 3.0 if n == 4 else torch.tensor(rng.standard_normal((T, V)))
    top, ids = teacher_logits.log_softmax(-1).topk(k, dim=-1)
    out = verl_kd.compute_forward_kl_topk(
        student_logits=student_logits.unsqueeze(0),
        teacher_topk_log_probs=torch.nested.nested_tensor([top], layout=torch.jagged),
        teacher_topk_ids=torch.nested.nested_tensor([ids], layout=torch.jagged),
        config=kd_config,
        data_format="thd",
    )
    # verl/trainer/distillation/losses.py::compute_forward_kl_topk clamps them at 0.
    losses = out["distillation_losses"][0].clamp_min(0.0)
    add(f"verl09_forward_kl_topk_{n}", "forward_kl_topk_09", "verl", f"{kd_src} (compute_forward_kl_topk)",
        dict(student_logits=student_logits.tolist(), teacher_topk_logprobs=top.tolist(), teacher_topk_ids=ids.tolist()),
        dict(losses=losses.tolist(), unclamped=out["distillation_losses"][0].tolist()))

doc = dict(
    about="Recorded by scripts/record_upstream_09.py from the PyPI wheels named in `upstream`, torch float64.",
    upstream={"verl": VERL, "openrlhf": OPENRLHF},
    torch=torch.__version__,
    cases=cases,
)
with open(out_path, "w") as f:
    json.dump(doc, f, indent=1)
print(f"{len(cases)} cases -> {out_path}")
