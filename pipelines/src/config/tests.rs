//! The config's documentation, parsing and validation.

use super::*;

#[test]
fn the_commented_defaults_parse_back_and_document_every_key() {
    for kind in PipelineKind::ALL {
        let defaults = RunConfig::defaults_for(*kind);
        let text = defaults.to_commented_toml(*kind);
        assert_eq!(
            RunConfig::load(*kind, Some((&text, "t")), &[]).unwrap(),
            defaults,
            "{}",
            kind.name()
        );
        // Only the keys the pipeline reads are printed.
        for &Key {
            section, name: key, ..
        } in KEYS
        {
            let printed = text.contains(&format!("\n[{section}]\n"))
                && text
                    .split(&format!("\n[{section}]\n"))
                    .nth(1)
                    .is_some_and(|rest| {
                        rest.split("\n[")
                            .next()
                            .unwrap()
                            .lines()
                            .any(|l| l.starts_with(&format!("{key} = ")))
                    });
            assert_eq!(
                printed,
                applies(*kind, section, key),
                "{}: {section}.{key}",
                kind.name()
            );
        }
        // Every serialised key has a doc line, and every doc line a key.
        let doc = toml::Value::try_from(&defaults).unwrap();
        let mut keys = 0;
        for (section, table) in doc.as_table().unwrap() {
            for key in table.as_table().unwrap().keys() {
                keys += 1;
                assert!(
                    KEYS.iter().any(|k| k.section == section && k.name == key),
                    "{section}.{key} is undocumented"
                );
            }
        }
        assert_eq!(keys, KEYS.len());
    }
}

#[test]
fn keys_that_would_change_nothing_are_refused() {
    let base = |kind| {
        let mut c = RunConfig::defaults_for(kind);
        c.model.path = "m".into();
        c
    };
    for (kind, item, needle) in [
        (
            PipelineKind::Sft,
            "algorithm.clip_low=0.3",
            "does not use this key",
        ),
        (
            PipelineKind::Rm,
            "generate.temperature=0.5",
            "does not use this key",
        ),
        (
            PipelineKind::Grpo,
            "algorithm.lambda=0.9",
            "does not use this key",
        ),
        (
            PipelineKind::Dpo,
            "algorithm.micro_batch=4",
            "does not use this key",
        ),
        (
            PipelineKind::Grpo,
            "reward.url=\"http://x\"",
            "reward.kind = \"remote\"",
        ),
        (
            PipelineKind::Grpo,
            "algorithm.correction_high=3.0",
            "algorithm.correction",
        ),
        (
            PipelineKind::Grpo,
            "algorithm.loss_scale_factor=512",
            "seq-mean-token-sum-norm",
        ),
        (PipelineKind::Dpo, "algorithm.label_smoothing=0.1", "cdpo"),
        (
            PipelineKind::Grpo,
            "curriculum.min_samples=4",
            "curriculum.enabled",
        ),
    ] {
        let err = base(kind)
            .with_overrides(&[item.to_string()])
            .unwrap()
            .validate(kind)
            .unwrap_err()
            .to_string();
        let key = item.split('=').next().unwrap();
        assert!(err.contains(key) && err.contains(needle), "{item}: {err}");
    }
    // The same keys act once their condition holds.
    for (kind, items) in [
        (
            PipelineKind::Grpo,
            &["reward.kind=remote", "reward.url=\"http://x\""][..],
        ),
        (
            PipelineKind::Grpo,
            &["algorithm.correction=tis", "algorithm.correction_high=3.0"],
        ),
        (PipelineKind::DrGrpo, &["algorithm.loss_scale_factor=512"]),
        (
            PipelineKind::Dpo,
            &[
                "algorithm.preference_loss=cdpo",
                "algorithm.label_smoothing=0.1",
            ],
        ),
        (
            PipelineKind::Ppo,
            &["algorithm.lambda=0.95", "algorithm.gamma=0.99"],
        ),
    ] {
        let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        base(kind)
            .with_overrides(&items)
            .unwrap()
            .validate(kind)
            .unwrap_or_else(|e| panic!("{items:?}: {e}"));
    }
}

#[test]
fn bad_keys_and_values_are_named() {
    let err = RunConfig::from_toml("[run]\nstepz = 3\n", "a.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("a.toml") && err.contains("stepz"), "{err}");
    let err = RunConfig::from_toml("[run]\nsteps = \"many\"\n", "a.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("steps"), "{err}");

    let mut c = RunConfig::defaults_for(PipelineKind::Grpo);
    c.model.path = "m".into();
    c.validate(PipelineKind::Grpo).unwrap();
    let set = |items: &[&str]| {
        c.clone()
            .with_overrides(&items.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    };
    let ok = set(&[
        "run.steps=7",
        "algorithm.schedule=cosine",
        "placement.train=[0, 1]",
    ])
    .unwrap();
    assert_eq!(
        (ok.run.steps, ok.algorithm.schedule),
        (7, super::ScheduleChoice::Cosine)
    );
    assert_eq!(ok.placement.train, vec![0, 1]);
    assert!(set(&["run.nope=1"])
        .unwrap_err()
        .to_string()
        .contains("unknown key `run.nope`"));
    for (items, key) in [
        (&["algorithm.kl_estimator=k9"][..], "algorithm.kl_estimator"),
        (&["placement.train=[5]"][..], "placement.train"),
        // Workers for a judge no reward uses.
        (&["placement.judge=[1]"][..], "placement.judge"),
        (
            &["data.samples_per_prompt=1"][..],
            "data.samples_per_prompt",
        ),
        (&["generate.temperature=0"][..], "generate.temperature"),
        (
            &[
                "dynamic_sampling.enabled=true",
                "dynamic_sampling.target_groups=9",
            ][..],
            "dynamic_sampling.target_groups",
        ),
        (&["reward.rule=nope"][..], "reward.rule"),
    ] {
        // A value outside a key's choices fails at parsing, others at validation.
        let err = set(items)
            .and_then(|c| c.validate(PipelineKind::Grpo))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{items:?}: {err}");
    }
    // The teacher's placement: a name, or workers that exist.
    let mut distill = RunConfig::defaults_for(PipelineKind::Distill);
    distill.model.path = "m".into();
    let placed = |item: &str| {
        distill
            .clone()
            .with_overrides(&[item.to_string()])
            .map(|c| c.placement.teacher)
    };
    assert_eq!(
        placed("placement.teacher=[1, 0]").unwrap(),
        super::TeacherPlacement::Workers(vec![1, 0])
    );
    assert_eq!(
        placed("placement.teacher=\"rollout\"").unwrap(),
        super::TeacherPlacement::At(super::ReferencePlacement::Rollout)
    );
    let err = placed("placement.teacher=\"elsewhere\"")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("placement.teacher") && err.contains("list of worker"),
        "{err}"
    );
    for item in ["placement.teacher=[5]", "placement.teacher=[]"] {
        let mut c = distill.clone().with_overrides(&[item.to_string()]).unwrap();
        c.teacher.path = "t".into();
        let err = c.check_placement().unwrap_err().to_string();
        assert!(err.contains("placement.teacher"), "{item}: {err}");
    }
    // A file overrides the pipeline's defaults key by key.
    let sft = RunConfig::load(
        PipelineKind::Sft,
        Some(("[run]\nsteps = 3\n", "f.toml")),
        &[],
    )
    .unwrap();
    assert_eq!((sft.run.steps, sft.algorithm.lr), (3, 1e-3));
    for (text, needle) in [
        ("[nope]\nx = 1\n", "unknown section `nope`"),
        ("[run]\nstepz = 1\n", "stepz"),
        ("run = 3\n", "must be a table"),
        (
            "[algorithm]\naggregation = \"token-avg\"\n",
            "`algorithm.aggregation`: unknown variant `token-avg`, expected one of",
        ),
    ] {
        let err = RunConfig::load(PipelineKind::Grpo, Some((text, "f.toml")), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("f.toml") && err.contains(needle), "{err}");
    }
    let mut no_model = RunConfig::default();
    no_model.model.path.clear();
    assert!(no_model
        .validate(PipelineKind::Grpo)
        .unwrap_err()
        .to_string()
        .contains("model.path"));
}

/// The KL estimator defaults to where the KL goes: k3 as a loss term (the
/// group pipelines, as TRL's and OpenRLHF's GRPO), k1 in the reward (ppo,
/// reinforce_pp*, remax), whose score-function gradient only k1 makes the
/// KL's (OpenRLHF's `--kl_estimator` and verl's `kl_penalty` default).
#[test]
fn the_kl_estimator_defaults_to_where_the_kl_goes() {
    for kind in PipelineKind::ALL {
        let want = match kind {
            PipelineKind::Ppo
            | PipelineKind::ReinforcePp
            | PipelineKind::ReinforcePpBaseline
            | PipelineKind::Remax => KlEstimator::K1,
            PipelineKind::Grpo
            | PipelineKind::DrGrpo
            | PipelineKind::Rloo
            | PipelineKind::Opo
            | PipelineKind::GrpoPassk
            | PipelineKind::Gpg
            | PipelineKind::Otb
            | PipelineKind::Distill
            | PipelineKind::Sft
            | PipelineKind::Rm
            | PipelineKind::Dpo => KlEstimator::K3,
        };
        let got = RunConfig::defaults_for(*kind).algorithm.kl_estimator;
        assert_eq!(got, want, "{}", kind.name());
    }
}

/// verl's flavor takes verl's dual clip (c = 3) unless one is set;
/// OpenRLHF's has none unless set.
#[test]
fn the_dual_clip_follows_the_flavor_unless_set() {
    let dual = |flavor, c| {
        let mut cfg = RunConfig::defaults_for(PipelineKind::Grpo);
        cfg.algorithm.flavor = flavor;
        cfg.algorithm.dual_clip = c;
        crate::roles::learner_config(&cfg, true).policy.dual_clip
    };
    assert_eq!(dual(Flavor::Verl, 0.0), Some(3.0));
    assert_eq!(dual(Flavor::Verl, 5.0), Some(5.0));
    assert_eq!(dual(Flavor::OpenRlhf, 0.0), None);
    assert_eq!(dual(Flavor::OpenRlhf, 2.0), Some(2.0));
}

#[test]
fn the_configuration_reference_is_what_weir_config_prints() {
    let page = super::reference_page();
    // The page's line of each key, by section.
    let mut lines = std::collections::HashMap::new();
    let mut section = "";
    for line in page.lines() {
        if let Some(s) = line
            .strip_prefix("## `[")
            .and_then(|l| l.strip_suffix("]`"))
        {
            section = s;
        } else if let Some(key) = line.strip_prefix("| `").and_then(|l| l.split('`').next()) {
            lines.insert((section, key), line);
        }
    }
    assert_eq!(lines.len(), super::KEYS.len(), "one line a key");
    // Every key of every pipeline, its default as that pipeline has it.
    for &kind in PipelineKind::ALL {
        let toml = RunConfig::defaults_for(kind).to_commented_toml(kind);
        let doc: toml::Value = toml::from_str(&toml).unwrap();
        for &Key {
            section,
            name: key,
            doc: help,
            ..
        } in KEYS
        {
            let line = lines[&(section, key)];
            let cells: Vec<&str> = line.split(" | ").collect();
            let read_by = cells[2] == "all"
                || cells[2]
                    .split(", ")
                    .any(|k| k == kind.name() || (k == super::docs::RL_PIPELINES && kind.is_rl()));
            assert_eq!(
                read_by,
                super::applies(kind, section, key),
                "{section}.{key}: {line}"
            );
            assert!(line.contains(&help.replace('|', "\\|")), "{line}");
            if read_by {
                let value = doc[section][key].to_string().replace('|', "\\|");
                assert!(
                    line.contains(&format!("`{value}`")),
                    "{section}.{key} of {}: the reference says {line}, weir config {value}",
                    kind.name()
                );
            }
        }
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
    let written = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        written == page,
        "{} is not `weir config --reference`: regenerate it with \
         cargo run -- config --reference > docs/configuration.md",
        path.display()
    );
}

#[test]
fn the_python_code_a_config_runs_is_listed() {
    let mut cfg = RunConfig::default();
    assert!(cfg.code_it_runs().is_empty(), "a rule runs no outside code");
    cfg.reward.kind = RewardKind::Python;
    cfg.reward.file = Some("/srv/r.py".into());
    cfg.reward.python = "/venv/bin/python".into();
    assert_eq!(
        cfg.code_it_runs(),
        vec!["Python /srv/r.py:reward_func with the interpreter `/venv/bin/python`".to_string()]
    );
    cfg.reward.kind = RewardKind::Terms;
    cfg.reward.terms = vec![
        RewardTerm {
            rule: Some("math".into()),
            ..Default::default()
        },
        RewardTerm {
            file: Some("t.py".into()),
            function: "score".into(),
            ..Default::default()
        },
    ];
    assert_eq!(
        cfg.code_it_runs(),
        vec!["Python t.py:score with the interpreter `/venv/bin/python`".to_string()]
    );
}

#[test]
fn every_key_is_a_field_declared_in_its_sections_file() {
    // Each section's file holds its struct and its rows of the key table:
    // a key is added in that one file.
    let files: &[(&str, &str, &[Key])] = &[
        ("run", include_str!("run.rs"), super::run::KEYS),
        (
            "placement",
            include_str!("placement.rs"),
            super::placement::KEYS,
        ),
        ("model", include_str!("model.rs"), super::model::KEYS),
        ("judge", include_str!("judge.rs"), super::judge::KEYS),
        ("teacher", include_str!("teacher.rs"), super::teacher::KEYS),
        ("data", include_str!("data.rs"), super::data::KEYS),
        (
            "generate",
            include_str!("generate.rs"),
            super::generate::KEYS,
        ),
        ("reward", include_str!("reward.rs"), super::reward::KEYS),
        (
            "algorithm",
            include_str!("algorithm.rs"),
            super::algorithm::KEYS,
        ),
        (
            "dynamic_sampling",
            include_str!("dynamic_sampling.rs"),
            super::dynamic_sampling::KEYS,
        ),
        (
            "curriculum",
            include_str!("curriculum.rs"),
            super::curriculum::KEYS,
        ),
        ("eval", include_str!("eval.rs"), super::eval::KEYS),
        ("lora", include_str!("lora.rs"), super::lora::KEYS),
        ("agent", include_str!("agent.rs"), super::agent::KEYS),
    ];
    for key in KEYS {
        let (_, text, rows) = files
            .iter()
            .find(|(section, ..)| *section == key.section)
            .unwrap_or_else(|| panic!("[{}] has no file of its own", key.section));
        assert!(
            text.contains(&format!("pub {}:", key.name)),
            "{}.{}: {}.rs declares no such field",
            key.section,
            key.name,
            key.section
        );
        assert!(
            rows.iter().any(|r| r.name == key.name),
            "{}.{}: not a row of {}.rs",
            key.section,
            key.name,
            key.section
        );
    }
    // The table is the files' rows end to end, each file's of its own section.
    let rows: Vec<(&str, &str)> = files
        .iter()
        .flat_map(|(section, _, rows)| {
            rows.iter().map(move |r| {
                assert_eq!(r.section, *section, "{}.{}", r.section, r.name);
                (r.section, r.name)
            })
        })
        .collect();
    let table: Vec<(&str, &str)> = KEYS.iter().map(|k| (k.section, k.name)).collect();
    assert_eq!(rows, table);
}
