//! The documents and the house stay true: every file path and `path::item` the README and docs/ name exists,
//! the README's layout lists the tree's top-level rooms, the README stays under 300 lines, and no source
//! file is over 800 lines nor any function over 150 (tests aside).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's top-level entries a path in a document may start with.
fn top_level(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "target" && n != ".git")
        .collect()
}

/// Paths (with an optional `::item`) a document names: tokens starting with a top-level entry, inside
/// backticks, code blocks or link targets. Placeholders (`<variant>`, `*`, `…`, `{a,b}`) are not paths.
fn named_paths(text: &str, tops: &[String]) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let sep = |c: char| c.is_whitespace() || "`()[]|\"',;=".contains(c);
    for tok in text.split(sep) {
        let tok = tok.trim_end_matches(['.', ':', '!']);
        let Some(first) = tok.split('/').next() else {
            continue;
        };
        if !tok.contains('/') && !tok.ends_with(".md") && !tok.ends_with(".toml") {
            continue;
        }
        if !tops
            .iter()
            .any(|t| t == first || tok.starts_with(&format!("{t}::")))
        {
            continue;
        }
        if tok.contains(['<', '*', '…', '{', '$', '#']) {
            continue;
        }
        let (path, item) = match tok.split_once("::") {
            Some((p, i)) => (p.to_string(), Some(i.to_string())),
            None => (tok.to_string(), None),
        };
        out.push((path, item));
    }
    out
}

/// A document's relative links (`[x](path)`, `[x](path#anchor)`), resolved against its own directory.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let Some(j) = rest.find(')') else { break };
        let target = rest[..j].split('#').next().unwrap_or("");
        if !target.is_empty() && !target.contains("://") {
            out.push(target.to_string());
        }
    }
    out
}

fn documents(root: &Path) -> Vec<PathBuf> {
    let mut docs = vec![root.join("README.md")];
    let mut stack = vec![root.join("docs")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                docs.push(p);
            }
        }
    }
    docs.sort();
    docs
}

/// Every path the documents name, as (document, path, item) that do not exist.
fn missing_paths(root: &Path) -> Vec<String> {
    let tops = top_level(root);
    let mut bad = Vec::new();
    for doc in documents(root) {
        let text = std::fs::read_to_string(&doc).unwrap();
        let rel = doc.strip_prefix(root).unwrap().display().to_string();
        for (path, item) in named_paths(&text, &tops) {
            let p = root.join(&path);
            if !p.exists() {
                bad.push(format!("{rel}: `{path}` does not exist"));
                continue;
            }
            if let Some(item) = item {
                let word = item.split("::").last().unwrap_or(&item);
                // A directory's items are in its mod.rs (a module folder).
                let file = if p.is_dir() {
                    p.join("mod.rs")
                } else {
                    p.clone()
                };
                let body = std::fs::read_to_string(&file).unwrap_or_default();
                let defined = [
                    "fn ", "struct ", "enum ", "mod ", "const ", "static ", "trait ", "type ",
                ]
                .iter()
                .any(|k| body.contains(&format!("{k}{word}")));
                if !defined {
                    bad.push(format!(
                        "{rel}: `{path}::{item}`: no `{word}` defined there"
                    ));
                }
            }
        }
        for l in links(&text) {
            if !doc.parent().unwrap().join(&l).exists() {
                bad.push(format!("{rel}: link ({l}) does not exist"));
            }
        }
    }
    bad
}

#[test]
fn every_path_the_docs_name_exists() {
    let bad = missing_paths(&root());
    assert!(bad.is_empty(), "stale paths:\n{}", bad.join("\n"));
}

/// The check itself fails when a named path is removed: a copy of the README and docs/ beside a tree that
/// lacks one file they name.
#[test]
fn the_path_check_catches_a_removed_path() {
    let tmp = tempfile::tempdir().unwrap();
    let r = tmp.path();
    std::fs::create_dir_all(r.join("docs")).unwrap();
    std::fs::create_dir_all(r.join("kernels/src")).unwrap();
    std::fs::write(r.join("kernels/src/dot.rs"), "pub fn matmul_slices() {}\n").unwrap();
    let readme = "See `kernels/src/dot.rs::matmul_slices` and [a](docs/a.md).\n";
    std::fs::write(r.join("README.md"), readme).unwrap();
    std::fs::write(
        r.join("docs/a.md"),
        "`kernels/src/rowmm/mod.rs` holds RowWeight.\n",
    )
    .unwrap();
    let bad = missing_paths(r);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("kernels/src/rowmm/mod.rs"), "{bad:?}");
    std::fs::remove_file(r.join("kernels/src/dot.rs")).unwrap();
    assert_eq!(missing_paths(r).len(), 2);
}

#[test]
fn readme_is_short_and_its_layout_matches_the_tree() {
    let root = root();
    let text = std::fs::read_to_string(root.join("README.md")).unwrap();
    let n = text.lines().count();
    assert!(
        n <= 300,
        "README.md is {n} lines (≤ 300: depth goes to docs/)"
    );
    let layout = text
        .split("## Layout")
        .nth(1)
        .and_then(|s| s.split("```").nth(1))
        .expect("a ## Layout section with a code block");
    let listed: Vec<&str> = layout
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.ends_with('/'))
        .collect();
    let dirs: Vec<String> = top_level(&root)
        .into_iter()
        .filter(|n| !n.starts_with('.') && root.join(n).is_dir())
        .map(|n| format!("{n}/"))
        .collect();
    for d in &dirs {
        assert!(listed.contains(&d.as_str()), "README layout lacks {d}");
    }
    for l in &listed {
        assert!(
            dirs.iter().any(|d| d == l),
            "README layout lists {l}, not in the tree"
        );
    }
}

/// (lines, path, first line, name) of every function longer than `max` lines in non-test code.
fn long_functions(src: &str, max: usize) -> Vec<(usize, usize, String)> {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i].trim_start();
        if l.starts_with("#[cfg(test)]") {
            break; // a file's test module is last by convention here
        }
        let is_fn = l.split("fn ").next().is_some_and(|pre| {
            pre.split_whitespace().all(|w| {
                [
                    "pub",
                    "pub(crate)",
                    "pub(super)",
                    "unsafe",
                    "const",
                    "extern",
                    "\"C\"",
                    "async",
                ]
                .contains(&w)
            })
        }) && l.contains("fn ")
            && !l.starts_with("//");
        if is_fn {
            let name = l
                .split("fn ")
                .nth(1)
                .unwrap_or("")
                .split(['(', '<'])
                .next()
                .unwrap_or("")
                .to_string();
            let (mut depth, mut started, mut j) = (0i64, false, i);
            while j < lines.len() {
                // Char literals of braces and quotes first, so they neither open a block nor a string.
                let code = lines[j]
                    .replace("'{'", "")
                    .replace("'}'", "")
                    .replace("'\"'", "");
                let code = code.split("//").next().unwrap_or("");
                let mut in_str = false;
                let mut prev = ' ';
                for c in code.chars() {
                    match c {
                        '"' if prev != '\\' => in_str = !in_str,
                        '{' if !in_str => {
                            depth += 1;
                            started = true
                        }
                        '}' if !in_str => depth -= 1,
                        _ => {}
                    }
                    prev = c;
                }
                if (started && depth <= 0) || (!started && code.trim_end().ends_with(';')) {
                    break;
                }
                j += 1;
            }
            if j - i + 1 > max {
                out.push((j - i + 1, i + 1, name));
            }
        }
        i += 1;
    }
    out
}

#[test]
fn no_source_file_over_800_lines_nor_function_over_150() {
    let root = root();
    let mut bad = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()) {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                // Test code and fixtures are not held to it.
                if !["target", ".git", "tests", "fixtures"].contains(&name.as_str())
                    && !name.starts_with('.')
                {
                    stack.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let src = std::fs::read_to_string(&p).unwrap();
            let rel = p.strip_prefix(&root).unwrap().display().to_string();
            let n = src.lines().count();
            if n > 800 {
                bad.push(format!("{rel}: {n} lines"));
            }
            for (len, at, f) in long_functions(&src, 150) {
                bad.push(format!("{rel}:{at}: fn {f} is {len} lines"));
            }
        }
    }
    assert!(bad.is_empty(), "over the house rules:\n{}", bad.join("\n"));
}

#[test]
fn the_function_scanner_measures_a_known_function() {
    let body: String = (0..200).map(|k| format!("    let x{k} = {k};\n")).collect();
    let src = format!("pub fn long() {{\n{body}}}\n\nfn short() {{\n    let s = \"}}\";\n}}\n");
    let got = long_functions(&src, 150);
    assert_eq!(got, vec![(202, 1, "long".to_string())]);
}
