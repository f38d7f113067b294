//! What the README shows as a file's code is that file's code.

/// The README's proxy, from `async fn proxy(` to the end of its block.
fn readme_proxy() -> &'static str {
    let readme = include_str!("../../README.md");
    let start = readme
        .find("async fn proxy(")
        .expect("the README shows the proxy");
    let len = readme[start..]
        .find("\n```")
        .expect("the proxy's block ends");
    &readme[start..=start + len]
}

#[test]
fn the_readme_proxy_is_the_one_in_examples_axum() {
    let example = include_str!("../../examples/axum.rs");
    let proxy = readme_proxy();
    assert!(
        example.contains(proxy),
        "README.md says its proxy is the whole of the one in examples/axum.rs; they differ:\n{proxy}"
    );
}

/// The series `text` names in its code spans (a PromQL expression's too), braces expanded
/// and labels left out: `tower_affinity_{a,b}_total{outcome}` is `tower_affinity_a_total`
/// and `tower_affinity_b_total`.
fn metric_names(text: &str) -> Vec<String> {
    fn expand(name: &str) -> Vec<String> {
        let Some(open) = name.find('{') else {
            return vec![name.to_string()];
        };
        let close = open + name[open..].find('}').expect("a closing brace");
        let (head, inner, tail) = (&name[..open], &name[open + 1..close], &name[close + 1..]);
        if !inner.contains(',') && tail.is_empty() {
            // Labels.
            return vec![head.to_string()];
        }
        (inner.split(','))
            .flat_map(|alt| expand(&format!("{head}{alt}{tail}")))
            .collect()
    }
    let mut names: Vec<String> = (text.split('`').skip(1).step_by(2))
        .flat_map(|code| {
            code.match_indices("tower_affinity_")
                .map(|(at, _)| &code[at..])
        })
        .map(|from| {
            let name = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "_{},".contains(c);
            &from[..from.find(|c| !name(c)).unwrap_or(from.len())]
        })
        .flat_map(expand)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Every series "How it places a request" names is one the `metrics` module's table lists
/// (which `tests/metrics` holds to what the balancer writes).
#[test]
fn the_series_the_readme_names_for_the_metrics_feature_are_in_the_metrics_modules_table() {
    let readme = include_str!("../../README.md");
    let start = readme.find("\n## How it places a request").unwrap();
    let end = start + readme[start..].find("\n## What clients send").unwrap();
    let named = metric_names(&readme[start..end]);
    assert!(named.len() >= 4, "{named:?}");
    let listed: Vec<String> = include_str!("../../src/metrics.rs")
        .lines()
        .filter_map(|line| line.strip_prefix("//! | `"))
        .filter_map(|row| Some(row.split_once('`')?.0.to_string()))
        .collect();
    let unlisted: Vec<_> = named.iter().filter(|n| !listed.contains(n)).collect();
    assert!(unlisted.is_empty(), "not in src/metrics.rs: {unlisted:?}");
}
