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
