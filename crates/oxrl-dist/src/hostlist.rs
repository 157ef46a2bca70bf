//! The two facts oxrl needs from Slurm's compressed lists: the first host of a node list
//! (`gpu-[07-08,12],login1` → `gpu-07`), where rank 0 runs, and the task count of one node in
//! a tasks-per-node list (`8(x2),4` → 8, 8, 4).

/// The first host a Slurm host list names, zero padding kept; `None` if it is malformed.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let entry = &list[..end];
    // Every bracket expression takes its first value: `[07-08,12]` → `07`.
    let mut host = String::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']')? + open;
        let first = rest[open + 1..close].split([',', '-']).next()?.trim();
        if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    (!host.is_empty()).then_some(host)
}

/// Node `node`'s task count in a `SLURM_TASKS_PER_NODE` list; `None` if malformed or short.
pub fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut seen = 0usize;
    for entry in list.trim().split(',') {
        let (count, repeat) = match entry.split_once("(x") {
            Some((count, repeat)) => (count, repeat.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (entry, 1),
        };
        let count = count.trim().parse::<usize>().ok()?;
        if node < seen + repeat {
            return Some(count);
        }
        seen += repeat;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_host_of_slurm_lists() {
        assert_eq!(first_host("node01").as_deref(), Some("node01"));
        assert_eq!(first_host("node[01-04]").as_deref(), Some("node01"));
        assert_eq!(
            first_host("gpu-[07-08,12],login1").as_deref(),
            Some("gpu-07")
        );
        assert_eq!(
            first_host("rack[3-4]-n[10,2]").as_deref(),
            Some("rack3-n10")
        );
        assert_eq!(first_host("a,b[1-2]").as_deref(), Some("a"));
        assert_eq!(first_host("n[1-2"), None);
        assert_eq!(first_host("n]"), None);
        assert_eq!(first_host("n[x]"), None);
        assert_eq!(first_host(""), None);
    }

    #[test]
    fn tasks_per_node_lists() {
        assert_eq!(tasks_on_node("8", 0), Some(8));
        assert_eq!(tasks_on_node("8(x2),4", 0), Some(8));
        assert_eq!(tasks_on_node("8(x2),4", 1), Some(8));
        assert_eq!(tasks_on_node("8(x2),4", 2), Some(4));
        assert_eq!(tasks_on_node("8(x2),4", 3), None);
        assert_eq!(tasks_on_node("8(x", 0), None);
    }
}
