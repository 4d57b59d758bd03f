//! Where a process of a multi-process run learns its place from the
//! launcher that started it: Slurm (`srun`), torchrun-style launchers and
//! Kubernetes indexed Jobs, by their environment variables. The command's
//! flags (`--processes`, `--process-id`, `--hostfile`) override what the
//! environment says.
//!
//! | launcher | process id | processes | peers |
//! |---|---|---|---|
//! | weir's own | `WEIR_PROCESS_ID` | `WEIR_PROCESSES` | `WEIR_HOSTS` (`host:port,…`) or `WEIR_HOST_PATTERN` (`{}` the process id) |
//! | Slurm | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_STEP_NODELIST` × `SLURM_STEP_TASKS_PER_NODE` (tasks placed in blocks, srun's default), ports `WEIR_PORT` (2101) + the task's place on its node |
//! | torchrun | `RANK` | `WORLD_SIZE` | on one node (`LOCAL_WORLD_SIZE` = `WORLD_SIZE`): `MASTER_ADDR`, ports `MASTER_PORT` + 1 + rank; across nodes, `WEIR_HOSTS` or `WEIR_HOST_PATTERN` |
//! | Kubernetes indexed Job | `JOB_COMPLETION_INDEX` | `WORLD_SIZE` or `WEIR_PROCESSES` | `WEIR_HOST_PATTERN`, e.g. `grpo-{}.grpo:2101` (the pods' hostnames under a headless service) |

use std::collections::HashMap;

/// What the environment says of this process's place in a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Launch {
    /// This process's id.
    pub process: Option<usize>,
    /// Processes in the run.
    pub processes: Option<usize>,
    /// `host:port` of every process, in process-id order.
    pub hosts: Option<Vec<String>>,
    /// Which variables said so, for the line that tells the user.
    pub source: Vec<String>,
}

/// The port a Slurm task's process listens on is this plus its place on its node.
pub const DEFAULT_PORT: u16 = 2101;

impl Launch {
    /// What `vars` (the process's environment) say; an error names the
    /// variable that cannot be read.
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Self, String> {
        let get = |name: &str| vars.get(name).map(|v| v.trim()).filter(|v| !v.is_empty());
        let number = |name: &str| -> Result<Option<usize>, String> {
            get(name)
                .map(|v| {
                    v.parse::<usize>()
                        .map_err(|_| format!("{name}={v:?} is not a whole number"))
                })
                .transpose()
        };
        let mut launch = Launch::default();
        let take = |launch: &mut Launch, id: &str, count: &str| -> Result<(), String> {
            if launch.process.is_none() {
                if let Some(v) = number(id)? {
                    launch.process = Some(v);
                    launch.source.push(id.to_string());
                }
            }
            if launch.processes.is_none() {
                if let Some(v) = number(count)? {
                    launch.processes = Some(v);
                    launch.source.push(count.to_string());
                }
            }
            Ok(())
        };
        take(&mut launch, "WEIR_PROCESS_ID", "WEIR_PROCESSES")?;
        take(&mut launch, "SLURM_PROCID", "SLURM_NTASKS")?;
        take(&mut launch, "RANK", "WORLD_SIZE")?;
        take(&mut launch, "JOB_COMPLETION_INDEX", "WORLD_SIZE")?;
        let port = match get("WEIR_PORT") {
            Some(v) => v
                .parse::<u16>()
                .map_err(|_| format!("WEIR_PORT={v:?} is not a port"))?,
            None => DEFAULT_PORT,
        };
        let count = launch.processes;
        launch.hosts = if let Some(list) = get("WEIR_HOSTS") {
            launch.source.push("WEIR_HOSTS".into());
            Some(list.split(',').map(|h| h.trim().to_string()).collect())
        } else if let Some(pattern) = get("WEIR_HOST_PATTERN") {
            if !pattern.contains("{}") {
                return Err(format!(
                    "WEIR_HOST_PATTERN={pattern:?} has no {{}} where the process id goes"
                ));
            }
            let count = count.ok_or("WEIR_HOST_PATTERN needs the process count (WORLD_SIZE, WEIR_PROCESSES or --processes)")?;
            launch.source.push("WEIR_HOST_PATTERN".into());
            Some(
                (0..count)
                    .map(|i| {
                        let host = pattern.replace("{}", &i.to_string());
                        if host.contains(':') {
                            host
                        } else {
                            format!("{host}:{port}")
                        }
                    })
                    .collect(),
            )
        } else if let (Some(nodes), Some(tasks)) = (
            get("SLURM_STEP_NODELIST").or(get("SLURM_JOB_NODELIST")),
            get("SLURM_STEP_TASKS_PER_NODE").or(get("SLURM_TASKS_PER_NODE")),
        ) {
            let nodes = expand_hostlist(nodes).map_err(|e| format!("SLURM_STEP_NODELIST: {e}"))?;
            let per_node =
                tasks_per_node(tasks).map_err(|e| format!("SLURM_STEP_TASKS_PER_NODE: {e}"))?;
            if per_node.len() != nodes.len() {
                return Err(format!(
                    "SLURM_STEP_NODELIST names {} nodes, SLURM_STEP_TASKS_PER_NODE {}",
                    nodes.len(),
                    per_node.len()
                ));
            }
            launch.source.push("SLURM_STEP_NODELIST".into());
            Some(
                nodes
                    .iter()
                    .zip(&per_node)
                    .flat_map(|(node, &n)| {
                        (0..n).map(move |local| format!("{node}:{}", port as usize + local))
                    })
                    .collect(),
            )
        } else if let (Some(master), Some(master_port)) =
            (get("MASTER_ADDR"), number("MASTER_PORT")?)
        {
            let local = number("LOCAL_WORLD_SIZE")?;
            match (count, local) {
                (Some(world), Some(local)) if local == world => {
                    launch.source.push("MASTER_ADDR".into());
                    Some((0..world).map(|r| format!("{master}:{}", master_port + 1 + r)).collect())
                }
                (Some(_), _) => {
                    return Err("MASTER_ADDR names one host, but the processes span several nodes: set WEIR_HOSTS (host:port,…) or WEIR_HOST_PATTERN (host-{}.domain:port)".into())
                }
                (None, _) => None,
            }
        } else {
            None
        };
        Ok(launch)
    }
}

/// Slurm's compressed host list (`node[01-03,07],gpu5`) as host names.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    let bytes: Vec<char> = list.chars().collect();
    let mut items = Vec::new();
    for (i, c) in bytes.iter().enumerate() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(bytes[start..i].iter().collect::<String>());
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Err(format!("{list:?}: a `]` without its `[`"));
        }
    }
    if depth != 0 {
        return Err(format!("{list:?}: a `[` without its `]`"));
    }
    items.push(bytes[start..].iter().collect());
    for item in items.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        out.extend(expand_item(item)?);
    }
    if out.is_empty() {
        return Err(format!("{list:?} names no host"));
    }
    Ok(out)
}

/// One item of a host list, its first bracket expanded (and the rest, in turn).
fn expand_item(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else {
        return Ok(vec![item.to_string()]);
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or_else(|| format!("{item:?}: a `[` without its `]`"))?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let mut out = Vec::new();
    for range in ranges.split(',') {
        let (a, b) = range.split_once('-').unwrap_or((range, range));
        let bad = || format!("{item:?}: `{range}` is not a number or a range of numbers");
        let (lo, hi): (u64, u64) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        if lo > hi {
            return Err(bad());
        }
        for n in lo..=hi {
            // Zero padding as written (`01-03`).
            for tail in expand_item(rest)? {
                out.push(format!("{prefix}{n:0width$}{tail}", width = a.len()));
            }
        }
    }
    Ok(out)
}

/// Slurm's tasks per node (`2(x3),1`) as one count per node.
pub fn tasks_per_node(spec: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let bad = || format!("{spec:?}: `{part}` is not N or N(xM)");
        let (n, times) = match part.split_once("(x") {
            Some((n, times)) => (n, times.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let (n, times): (usize, usize) = (
            n.parse().map_err(|_| bad())?,
            times.parse().map_err(|_| bad())?,
        );
        out.extend(std::iter::repeat_n(n, times));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn slurm_host_lists_and_task_counts_expand() {
        assert_eq!(
            expand_hostlist("node[01-03,07],gpu5").unwrap(),
            ["node01", "node02", "node03", "node07", "gpu5"]
        );
        assert_eq!(
            expand_hostlist("r[1-2]n[8-9]").unwrap(),
            ["r1n8", "r1n9", "r2n8", "r2n9"]
        );
        assert_eq!(tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert!(expand_hostlist("node[1-")
            .unwrap_err()
            .contains("without its"));
        assert!(tasks_per_node("2(x").unwrap_err().contains("N(xM)"));
    }

    #[test]
    fn each_launcher_gives_the_id_count_and_peers() {
        let slurm = Launch::from_vars(&vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
        ]))
        .unwrap();
        assert_eq!((slurm.process, slurm.processes), (Some(3), Some(4)));
        assert_eq!(
            slurm.hosts.unwrap(),
            ["n1:2101", "n1:2102", "n2:2101", "n2:2102"]
        );
        let torchrun = Launch::from_vars(&vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(torchrun.process, Some(1));
        assert_eq!(
            torchrun.hosts.unwrap(),
            ["127.0.0.1:29501", "127.0.0.1:29502"]
        );
        let k8s = Launch::from_vars(&vars(&[
            ("JOB_COMPLETION_INDEX", "0"),
            ("WORLD_SIZE", "2"),
            ("WEIR_HOST_PATTERN", "grpo-{}.grpo"),
        ]))
        .unwrap();
        assert_eq!(k8s.hosts.unwrap(), ["grpo-0.grpo:2101", "grpo-1.grpo:2101"]);
        // Across nodes, MASTER_ADDR alone does not name the peers.
        let err = Launch::from_vars(&vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap_err();
        assert!(err.contains("WEIR_HOST_PATTERN"), "{err}");
        let err = Launch::from_vars(&vars(&[("SLURM_PROCID", "x")])).unwrap_err();
        assert_eq!(err, "SLURM_PROCID=\"x\" is not a whole number");
        assert_eq!(Launch::from_vars(&vars(&[])).unwrap(), Launch::default());
    }
}
