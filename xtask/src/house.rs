//! House rules on the sources that neither rustc nor clippy checks, a gate of `cargo xtask test`:
//!
//! - **No source file over [`MAX_FILE_LINES`] lines** in the crates' `src/` folders, except tests
//!   (files named `tests.rs` and anything in a `tests/` folder) and generated or data tables
//!   (files named `tables.rs`: a table grows with what it lists, not with what the code does).
//! - **No import circle between modules** of the crates in [`CIRCLE_CRATES`]. A module uses
//!   another where its file names it by a `crate::`, `super::` or `self::` path (in a `use` or in
//!   code; `#[cfg(test)]` modules, comments and string literals aside). At every level of the
//!   module tree, each child of a module stands for itself and its descendants; the children must
//!   not use each other in a circle. A module using its parent or its own descendants is ordinary
//!   Rust and no circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Longer files are split by concern.
const MAX_FILE_LINES: usize = 700;

/// The folders whose files' length is checked, from the workspace root.
const SOURCE_DIRS: &[&str] = &["pyebpf/src", "pyebpf-common/src", "pyebpf-ebpf/src", "xtask/src"];

/// The crates whose modules must use each other without a circle, from the workspace root.
const CIRCLE_CRATES: &[&str] = &["pyebpf", "pyebpf-ebpf"];

/// Every breach of the house rules under the workspace `root`, one line each.
pub fn offenders(root: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for dir in SOURCE_DIRS {
        found.extend(long_files(root, &root.join(dir))?);
    }
    for krate in CIRCLE_CRATES {
        found.extend(import_circles(krate, &root.join(krate).join("src"))?);
    }
    Ok(found)
}

/// The files under `dir` over [`MAX_FILE_LINES`] lines, tests and tables aside.
fn long_files(root: &Path, dir: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for file in rust_files(dir)? {
        if is_test(dir, &file) || file.file_name().is_some_and(|name| name == "tables.rs") {
            continue;
        }
        let lines = read(&file)?.lines().count();
        if lines > MAX_FILE_LINES {
            let shown = file.strip_prefix(root).unwrap_or(&file).display();
            found.push(format!("{shown}: {lines} lines (at most {MAX_FILE_LINES} outside tests and tables)"));
        }
    }
    Ok(found)
}

/// Whether `file` (under `dir`) is test code: `tests.rs`, or in a `tests/` folder.
fn is_test(dir: &Path, file: &Path) -> bool {
    file.file_name().is_some_and(|name| name == "tests.rs")
        || file.strip_prefix(dir).is_ok_and(|rel| rel.parent().is_some_and(|p| p.iter().any(|c| c == "tests")))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        for entry in std::fs::read_dir(&folder).with_context(|| format!("read {}", folder.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

fn read(file: &Path) -> Result<String> {
    std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))
}

/// A module's path from its crate's root (empty for the root itself).
type Module = Vec<String>;

/// The import circles among the modules of the crate whose sources are in `src`, one line each.
fn import_circles(krate: &str, src: &Path) -> Result<Vec<String>> {
    let files = module_files(src)?;
    let modules: BTreeSet<Module> = files.keys().cloned().collect();
    let mut uses = BTreeSet::new();
    for (module, file) in &files {
        for path in used_paths(module, &read(file)?) {
            if let Some(target) = modules.iter().filter(|m| path.starts_with(m)).max_by_key(|m| m.len()) {
                uses.insert((module.clone(), target.clone()));
            }
        }
    }
    Ok(circles(&uses).into_iter().map(|circle| format!("{krate}: import circle between {}", circle.join(", "))).collect())
}

/// The crate's modules with their files: the root (`lib.rs`, else `main.rs`) and every other
/// file under `src` (`a/b.rs` and `a/b/mod.rs` are `a::b`), test files and `src/bin/` aside.
fn module_files(src: &Path) -> Result<BTreeMap<Module, PathBuf>> {
    let root_file = if src.join("lib.rs").exists() { "lib.rs" } else { "main.rs" };
    let mut modules = BTreeMap::new();
    for file in rust_files(src)? {
        let rel = file.strip_prefix(src)?;
        if is_test(src, &file)
            || rel.starts_with("bin")
            || (rel.parent() == Some(Path::new("")) && matches!(rel.to_str(), Some("lib.rs" | "main.rs")) && rel != Path::new(root_file))
        {
            continue;
        }
        let mut module: Module = rel.with_extension("").iter().map(|c| c.to_string_lossy().into_owned()).collect();
        if matches!(module.last().map(String::as_str), Some("mod")) || rel == Path::new(root_file) {
            module.pop();
        }
        modules.insert(module, file);
    }
    Ok(modules)
}

/// The absolute paths (from the crate root) that the source of `module` names with `crate::`,
/// `super::` or `self::`, its test modules, comments and literals aside.
fn used_paths(module: &[String], source: &str) -> Vec<Vec<String>> {
    let code = without_test_modules(&without_comments_and_literals(source));
    let mut paths = Vec::new();
    let mut at = 0;
    while let Some(found) = code[at..].find("::") {
        let colons = at + found;
        at = colons + 2;
        let start = code[..colons].rfind(|c: char| !is_ident_char(c)).map_or(0, |i| i + 1);
        if start > 0 && matches!(code.as_bytes()[start - 1], b'$' | b':') {
            continue;
        }
        let base: Module = match &code[start..colons] {
            "crate" => Vec::new(),
            "self" => module.to_vec(),
            "super" => module[..module.len().saturating_sub(1)].to_vec(),
            _ => continue,
        };
        let mut parser = UseTree { text: &code, at: colons };
        for tail in parser.trees() {
            paths.push(resolve(&base, tail));
        }
    }
    paths
}

/// `base` followed by `tail`, whose leading `super`s climb and whose `self`s stay.
fn resolve(base: &[String], tail: Vec<String>) -> Vec<String> {
    let mut path = base.to_vec();
    for segment in tail {
        match segment.as_str() {
            "super" => {
                path.pop();
            }
            "self" => {}
            _ => path.push(segment),
        }
    }
    path
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// A path's rest after its first segment, from `::`: more segments, possibly ending in a `{…}`
/// group of paths (a `use` tree) that multiplies it.
struct UseTree<'a> {
    text: &'a str,
    at: usize,
}

impl UseTree<'_> {
    /// The paths from here: `::a::b`, `::a::{b, c::d}` (two), or one empty path where no `::`
    /// follows.
    fn trees(&mut self) -> Vec<Vec<String>> {
        let mut prefix = Vec::new();
        while self.eat("::") {
            if self.eat("{") {
                let mut paths: Vec<Vec<String>> = Vec::new();
                loop {
                    self.skip_space();
                    let start = self.at;
                    let inner = self.segment().map(|first| vec![first]).unwrap_or_default();
                    for rest in self.trees() {
                        paths.push(inner.iter().cloned().chain(rest).collect());
                    }
                    self.skip_alias();
                    if !self.eat(",") || self.at == start {
                        break;
                    }
                }
                self.eat("}");
                return paths.into_iter().map(|path| prefix.iter().cloned().chain(path).collect()).collect();
            }
            match self.segment() {
                Some(segment) => prefix.push(segment),
                None => break,
            }
        }
        vec![prefix]
    }

    fn segment(&mut self) -> Option<String> {
        self.skip_space();
        let len = self.text[self.at..].find(|c: char| !is_ident_char(c)).unwrap_or(self.text.len() - self.at);
        (len > 0).then(|| {
            self.at += len;
            self.text[self.at - len..self.at].to_string()
        })
    }

    fn skip_alias(&mut self) {
        self.skip_space();
        if self.text[self.at..].starts_with("as ") {
            self.at += 3;
            self.segment();
        }
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_space();
        let found = self.text[self.at..].starts_with(token);
        if found {
            self.at += token.len();
        }
        found
    }

    fn skip_space(&mut self) {
        self.at += self.text[self.at..].len() - self.text[self.at..].trim_start().len();
    }
}

/// `source` with its comments and its string and character literals blanked out (a path in them
/// names nothing), lines kept.
fn without_comments_and_literals(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < chars.len() {
        let rest = &chars[i..];
        let end = if rest.starts_with(&['/', '/']) {
            rest.iter().position(|&c| c == '\n').map_or(chars.len(), |n| i + n)
        } else if rest.starts_with(&['/', '*']) {
            (i + 2..chars.len()).find(|&j| chars[j - 1] == '*' && chars[j] == '/').map_or(chars.len(), |j| j + 1)
        } else if let Some(len) = raw_string_len(rest) {
            i + len
        } else if rest[0] == '"' {
            quoted_end(&chars, i, '"')
        } else if rest[0] == '\'' && (rest.get(1) == Some(&'\\') || rest.get(2) == Some(&'\'')) {
            quoted_end(&chars, i, '\'')
        } else {
            out.push(rest[0]);
            i += 1;
            continue;
        };
        out.extend(chars[i..end].iter().map(|&c| if c == '\n' { '\n' } else { ' ' }));
        i = end;
    }
    out
}

/// The length of the raw string literal (`r"…"`, `r#"…"#`, `br"…"`) that `rest` starts with.
fn raw_string_len(rest: &[char]) -> Option<usize> {
    let skip = if rest.starts_with(&['b', 'r']) {
        2
    } else if rest.first() == Some(&'r') {
        1
    } else {
        return None;
    };
    let hashes = rest[skip..].iter().take_while(|&&c| c == '#').count();
    if rest.get(skip + hashes) != Some(&'"') {
        return None;
    }
    let body = skip + hashes + 1;
    let close: Vec<char> = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
    (body..rest.len()).find(|&j| rest[j..].starts_with(&close)).map(|j| j + close.len()).or(Some(rest.len()))
}

/// Where the literal opened by `quote` at `start` ends (after its closing quote).
fn quoted_end(chars: &[char], start: usize, quote: char) -> usize {
    let mut j = start + 1;
    while j < chars.len() {
        match chars[j] {
            '\\' => j += 2,
            c if c == quote => return j + 1,
            _ => j += 1,
        }
    }
    chars.len()
}

/// `code` (without comments and literals) with every `#[cfg(test)]` module's body removed.
fn without_test_modules(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(found) = rest.find("#[cfg(test)]") {
        let after = &rest[found + "#[cfg(test)]".len()..];
        let mut item = after.trim_start();
        while let Some(attribute) = item.strip_prefix("#[") {
            item = attribute[attribute.find(']').map_or(attribute.len(), |end| end + 1)..].trim_start();
        }
        // A module with a body; `mod tests;` is a file of its own, left out by its name.
        let body = item.find(['{', ';']).filter(|&at| item.starts_with("mod ") && item.as_bytes()[at] == b'{');
        out.push_str(&rest[..found]);
        match body {
            Some(open) => {
                let skipped = after.len() - item.len() + block_end(&item[open..]) + open;
                rest = &after[skipped.min(after.len())..];
            }
            None => rest = after,
        }
    }
    out.push_str(rest);
    out
}

/// The length of the `{…}` block `block` starts with, braces matched.
fn block_end(block: &str) -> usize {
    let mut depth = 0usize;
    for (at, c) in block.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return at + 1;
                }
            }
            _ => {}
        }
    }
    block.len()
}

/// The circles among `uses` (module, module used): at each level of the module tree, the
/// children of one module (each with its descendants) in a strongly connected component of more
/// than one; each named by its members' paths.
fn circles(uses: &BTreeSet<(Module, Module)>) -> Vec<Vec<String>> {
    let mut levels: BTreeMap<Module, BTreeSet<(Module, Module)>> = BTreeMap::new();
    for (from, to) in uses {
        let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        // One contains the other: a module and its parent or descendant.
        if common == from.len() || common == to.len() {
            continue;
        }
        levels.entry(from[..common].to_vec()).or_default().insert((from[..=common].to_vec(), to[..=common].to_vec()));
    }
    let mut found = Vec::new();
    for edges in levels.values() {
        for component in components(edges) {
            found.push(component.iter().map(|module| module.join("::")).collect());
        }
    }
    found
}

/// The strongly connected components of more than one node of the graph `edges`: the nodes that
/// reach each other.
fn components(edges: &BTreeSet<(Module, Module)>) -> Vec<BTreeSet<Module>> {
    let reach = |start: &Module| {
        let mut seen = BTreeSet::new();
        let mut pending = vec![start.clone()];
        while let Some(node) = pending.pop() {
            for (_, to) in edges.iter().filter(|(from, _)| *from == node) {
                if seen.insert(to.clone()) {
                    pending.push(to.clone());
                }
            }
        }
        seen
    };
    let nodes: BTreeSet<Module> = edges.iter().map(|(from, _)| from.clone()).collect();
    let reached: BTreeMap<&Module, BTreeSet<Module>> = nodes.iter().map(|node| (node, reach(node))).collect();
    let mut found: Vec<BTreeSet<Module>> = Vec::new();
    for node in &nodes {
        let component: BTreeSet<Module> = reached[node].iter().filter(|other| reached.get(other).is_some_and(|back| back.contains(node))).cloned().collect();
        if component.len() > 1 && !found.contains(&component) {
            found.push(component);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A crate's source tree in a fresh temporary folder, from (path, contents) pairs.
    fn tree(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-house-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, contents) in files {
            let file = dir.join(path);
            std::fs::create_dir_all(file.parent().expect("in the folder")).expect("create folder");
            std::fs::write(file, contents).expect("write file");
        }
        dir
    }

    #[test]
    fn a_tree_without_circles_passes() {
        let src = tree(
            "clean",
            &[
                ("main.rs", "mod a;\nmod b;\nmod c;\nuse crate::a::f;\nstatic X: u8 = 0;\n"),
                ("a.rs", "use crate::{b::g, X};\n// crate::c::h would be a circle, but it is a comment\npub fn f() {}\n"),
                ("b.rs", "pub fn g() { let _ = \"crate::a::f\"; }\n#[cfg(test)]\n#[allow(unused)]\nmod tests {\n    use crate::a;\n}\n"),
                ("c/mod.rs", "mod d;\nuse self::d::k;\nuse crate::a;\n"),
                // Up to the parent and back down is no circle.
                ("c/d.rs", "use super::super::c;\npub fn k() {}\n"),
                ("tests.rs", "use crate::c::d;\n"),
                ("b/tests/x.rs", "use crate::c::d;\n"),
            ],
        );
        assert_eq!(import_circles("clean", &src).expect("readable"), Vec::<String>::new());
        assert_eq!(long_files(&src, &src).expect("readable"), Vec::<String>::new());
    }

    #[test]
    fn circles_and_long_files_are_named() {
        let long = "fn f() {}\n".repeat(MAX_FILE_LINES + 1);
        let src = tree(
            "circles",
            &[
                ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
                ("main.rs", "fn main() {}\n"),
                ("a.rs", "use crate::{b::{self as bee, g}};\n"),
                ("b.rs", "pub fn g() { crate::c::d::h() }\n"),
                ("c/mod.rs", "pub mod d;\npub mod e;\n"),
                ("c/d.rs", "pub fn h() { super::e::i() }\n"),
                ("c/e.rs", "use crate::a;\nuse super::d;\npub fn i() {}\n"),
                ("long.rs", &long),
                ("tables.rs", &long),
                ("tests/long.rs", &long),
            ],
        );
        assert_eq!(import_circles("circles", &src).expect("readable"), ["circles: import circle between a, b, c", "circles: import circle between c::d, c::e"]);
        assert_eq!(long_files(&src, &src).expect("readable"), [format!("long.rs: {} lines (at most 700 outside tests and tables)", MAX_FILE_LINES + 1)]);
    }
}
