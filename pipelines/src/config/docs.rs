//! What every config key means: the key table, assembled from the rows
//! each section's file keeps beside its fields, the comments `weir config`
//! prints, and the configuration reference (`docs/configuration.md`,
//! printed by `weir config --reference`).

use super::RunConfig;
use crate::PipelineKind;

/// A config key: its section and name, the pipelines that read it, and
/// what it means (what `weir config` prints above it).
#[derive(Clone, Copy, Debug)]
pub struct Key {
    /// The TOML section.
    pub section: &'static str,
    /// The key's name in it.
    pub name: &'static str,
    /// The pipelines that read it.
    pub readers: Readers,
    /// What it means.
    pub doc: &'static str,
}

/// A row of [`KEYS`] (each section's file lists its own).
pub(super) const fn key(
    section: &'static str,
    name: &'static str,
    readers: Readers,
    doc: &'static str,
) -> Key {
    Key {
        section,
        name,
        readers,
        doc,
    }
}

/// Every key, in file order: each section's rows (its file's `KEYS`, beside
/// its fields), the sections in this order. A new key is a field of its
/// section and a row in the same file.
pub const KEYS: &[Key] = &ALL_KEYS;

/// The sections' rows, in the order [`KEYS`] lists them.
const SECTIONS: &[&[Key]] = &[
    super::run::KEYS,
    super::placement::KEYS,
    super::model::KEYS,
    super::judge::KEYS,
    super::teacher::KEYS,
    super::data::KEYS,
    super::generate::KEYS,
    super::reward::KEYS,
    super::algorithm::KEYS,
    super::dynamic_sampling::KEYS,
    super::curriculum::KEYS,
    super::eval::KEYS,
    super::lora::KEYS,
    super::agent::KEYS,
];

/// How many keys there are in all.
const COUNT: usize = {
    let (mut count, mut s) = (0, 0);
    while s < SECTIONS.len() {
        count += SECTIONS[s].len();
        s += 1;
    }
    count
};

/// [`SECTIONS`] end to end, made when compiling.
const ALL_KEYS: [Key; COUNT] = {
    let mut all = [SECTIONS[0][0]; COUNT];
    let (mut s, mut at) = (0, 0);
    while s < SECTIONS.len() {
        let mut k = 0;
        while k < SECTIONS[s].len() {
            all[at] = SECTIONS[s][k];
            (k, at) = (k + 1, at + 1);
        }
        s += 1;
    }
    all
};

/// Which pipelines read a key (the [`KEYS`] table says it of each key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readers {
    /// Every pipeline.
    All,
    /// The RL pipelines.
    Rl,
    /// The RL pipelines and sft (micro-batches, the label).
    RlAndSft,
    /// The RL pipelines and dpo (a reference model).
    RlAndDpo,
    /// The RL pipelines and rm (a reward model).
    RlAndRm,
    /// The group pipelines (the DAPO filter, the curriculum).
    Group,
    /// ppo and reinforce_pp: discounted returns. REINFORCE++-baseline's
    /// return is undiscounted in both references (OpenRLHF sets γ = 1 for
    /// it; verl puts the centred total on every token).
    Returns,
    /// The pipelines that put the KL in the reward, which the adaptive
    /// controller moves: ppo, reinforce_pp(_baseline), remax.
    InRewardKl,
    /// ppo.
    Ppo,
    /// grpo and dr_grpo (GDPO's per-term normalisation).
    GrpoFamily,
    /// distill.
    Distill,
    /// dpo.
    Dpo,
    /// rm.
    Rm,
    /// rm and dpo: preference pairs.
    Preference,
    /// Every pipeline but rm and dpo (preference pairs carry their
    /// responses: no room to leave).
    NotPreference,
    /// The RL pipelines whose rows may be episodes: all but remax (whose
    /// greedy baseline rows are single responses) and distill (whose
    /// teacher scores single responses).
    Agentic,
    /// Every pipeline but rm: a reward model has no policy to evaluate, and
    /// trains its score head, which adapters do not reach.
    NotRm,
}

impl Readers {
    /// Whether `pipeline` is among them.
    pub fn read_by(self, pipeline: PipelineKind) -> bool {
        use PipelineKind::*;
        match self {
            Readers::All => true,
            Readers::Rl => pipeline.is_rl(),
            Readers::RlAndSft => pipeline.is_rl() || pipeline == Sft,
            Readers::RlAndDpo => pipeline.is_rl() || pipeline == Dpo,
            Readers::RlAndRm => pipeline.is_rl() || pipeline == Rm,
            Readers::Group => pipeline.is_group(),
            Readers::Returns => matches!(pipeline, Ppo | ReinforcePp),
            Readers::InRewardKl => {
                matches!(pipeline, Ppo | ReinforcePp | ReinforcePpBaseline | Remax)
            }
            Readers::Ppo => pipeline == Ppo,
            Readers::GrpoFamily => matches!(pipeline, Grpo | DrGrpo),
            Readers::Distill => pipeline == Distill,
            Readers::Dpo => pipeline == Dpo,
            Readers::Rm => pipeline == Rm,
            Readers::Preference => matches!(pipeline, Rm | Dpo),
            Readers::NotPreference => !matches!(pipeline, Rm | Dpo),
            Readers::NotRm => pipeline != Rm,
            Readers::Agentic => pipeline.is_rl() && !matches!(pipeline, Remax | Distill),
        }
    }
}

/// Whether `pipeline` reads `section.key` at all (false for a key that does not exist).
pub fn applies(pipeline: PipelineKind, section: &str, key: &str) -> bool {
    find(section, key).is_some_and(|k| k.readers.read_by(pipeline))
}

/// The key `section.name`, if there is one.
pub fn find(section: &str, name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.section == section && k.name == name)
}

/// The configuration reference in Markdown: every key by section, with its
/// default, the pipelines that read it and what it means; made from the
/// same table and defaults as `weir config PIPELINE`, so it cannot drift.
pub fn reference_page() -> String {
    let defaults: Vec<(PipelineKind, toml::Value)> = PipelineKind::ALL
        .iter()
        .map(|&kind| {
            let value = toml::Value::try_from(RunConfig::defaults_for(kind));
            (kind, value.expect("a config serialises"))
        })
        .collect();
    let mut out = String::from(
        "# Configuration reference\n\n\
         Every key of a run config, by section: its default, the pipelines that\n\
         read it, and what it means. `weir config PIPELINE` prints the keys one\n\
         pipeline reads as a commented TOML file; a key set where it would\n\
         change nothing is refused with one line naming it. This page is\n\
         `weir config --reference`, and a test holds it to that.\n",
    );
    let mut section = "";
    for &Key {
        section: s,
        name: key,
        doc: help,
        ..
    } in KEYS
    {
        if s != section {
            out.push_str(&format!(
                "\n## `[{s}]`\n\n| key | default | read by | meaning |\n|---|---|---|---|\n"
            ));
            section = s;
        }
        let readers: Vec<(PipelineKind, String)> = defaults
            .iter()
            .filter(|(kind, _)| applies(*kind, s, key))
            .map(|(kind, doc)| (*kind, doc[s][key].to_string()))
            .collect();
        let kinds: Vec<PipelineKind> = readers.iter().map(|(k, _)| *k).collect();
        let read_by = readers_cell(&kinds);
        out.push_str(&format!(
            "| `{key}` | {} | {read_by} | {} |\n",
            default_cell(&readers),
            help.replace('|', "\\|")
        ));
    }
    out
}

/// Who reads a key: `all`, `RL pipelines` (with any others named), or
/// the pipelines by name.
fn readers_cell(kinds: &[PipelineKind]) -> String {
    if kinds.len() == PipelineKind::ALL.len() {
        return "all".into();
    }
    let rl = PipelineKind::ALL.iter().filter(|k| k.is_rl());
    let all_rl = rl.clone().all(|k| kinds.contains(k));
    let mut names: Vec<&str> = Vec::new();
    if all_rl {
        names.push(RL_PIPELINES);
    }
    names.extend(
        kinds
            .iter()
            .filter(|k| !(all_rl && k.is_rl()))
            .map(|k| k.name()),
    );
    names.join(", ")
}

/// What [`readers_cell`] calls every RL pipeline.
pub(super) const RL_PIPELINES: &str = "RL pipelines";

/// A key's default as its readers have it: one value, or the value of each
/// group of pipelines where they differ (the largest group as `others`).
fn default_cell(readers: &[(PipelineKind, String)]) -> String {
    let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
    for (kind, value) in readers {
        match groups.iter_mut().find(|(v, _)| v == value) {
            Some((_, kinds)) => kinds.push(kind.name()),
            None => groups.push((value, vec![kind.name()])),
        }
    }
    let cell = match groups.len() {
        0 => String::new(),
        1 => format!("`{}`", groups[0].0),
        _ => {
            let largest = (0..groups.len())
                .max_by_key(|&i| (groups[i].1.len(), std::cmp::Reverse(i)))
                .expect("two groups or more");
            let (common, _) = groups.remove(largest);
            let mut parts: Vec<String> = groups
                .iter()
                .map(|(v, kinds)| format!("{}: `{v}`", kinds.join(", ")))
                .collect();
            parts.push(format!("others: `{common}`"));
            parts.join("; ")
        }
    };
    cell.replace('|', "\\|")
}
