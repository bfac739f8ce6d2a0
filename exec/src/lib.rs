//! The program a command names, found as a shell finds it: a path as it is, a name
//! in the folders of PATH; what cannot run gets a shell's exit code (127 not
//! found, 126 not executable or not a program) and words that name the fix. Used by
//! `kvpn run` (before anything is connected) and `kvpn lab exec` (before entering
//! a namespace).
//!
//! I/O: file metadata and the first bytes of the file found.

use std::path::{Path, PathBuf};

/// Exit status of a command that cannot be found (as shells use it).
pub const EXIT_NOT_FOUND: i32 = 127;
/// Exit status of a command that was found but cannot be executed.
pub const EXIT_NOT_EXECUTABLE: i32 = 126;

/// Why a command cannot be started (`kvpn run`, `kvpn lab exec`).
#[derive(Debug, PartialEq, Eq)]
pub enum NotRunnable {
    /// No such file (a path), or in no folder of PATH (a name).
    NotFound(String),
    /// It exists but is a folder or has no execute permission.
    NotExecutable(PathBuf),
    /// Executable, but neither an ELF binary nor a `#!` script: execve fails
    /// with ENOEXEC ("exec format error").
    NotAProgram(PathBuf),
}

impl NotRunnable {
    /// A shell's exit code for it.
    pub fn exit_code(&self) -> i32 {
        match self {
            NotRunnable::NotFound(_) => EXIT_NOT_FOUND,
            NotRunnable::NotExecutable(_) | NotRunnable::NotAProgram(_) => EXIT_NOT_EXECUTABLE,
        }
    }
}

impl std::fmt::Display for NotRunnable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotRunnable::NotFound(p) if p.contains('/') => {
                write!(f, "{p}: no such file — check the path")
            }
            NotRunnable::NotFound(p) => write!(
                f,
                "{p}: command not found — install it, or give its full path (PATH is searched)"
            ),
            NotRunnable::NotExecutable(p) => write!(
                f,
                "{}: permission denied (a folder, or no execute permission) — `chmod +x` it",
                p.display()
            ),
            NotRunnable::NotAProgram(p) => write!(
                f,
                "{}: exec format error — neither an ELF binary nor a script starting with #!; \
                 run it through its interpreter (e.g. `sh {}`)",
                p.display(),
                p.display()
            ),
        }
    }
}

/// The file `program` names as a shell finds it: a path (with a `/`) as it is,
/// a name in the folders of `path_var` (an empty entry is the working folder),
/// the first executable file winning.
pub fn find_program(
    program: &str,
    path_var: Option<&std::ffi::OsStr>,
) -> Result<PathBuf, NotRunnable> {
    use std::os::unix::fs::PermissionsExt as _;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if executable(&p) {
            runnable_format(p)
        } else if p.exists() {
            Err(NotRunnable::NotExecutable(p))
        } else {
            Err(NotRunnable::NotFound(program.to_owned()))
        };
    }
    let mut not_executable = None;
    if !program.is_empty() {
        for dir in std::env::split_paths(path_var.unwrap_or_default()) {
            let dir = if dir.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                dir
            };
            let p = dir.join(program);
            if executable(&p) {
                return runnable_format(p);
            }
            if not_executable.is_none() && p.is_file() {
                not_executable = Some(p);
            }
        }
    }
    Err(not_executable.map_or_else(
        || NotRunnable::NotFound(program.to_owned()),
        NotRunnable::NotExecutable,
    ))
}

/// `p` when the kernel can exec it: an ELF binary or a `#!` script (what
/// execve accepts; a file it cannot read is left to execve to judge).
fn runnable_format(p: PathBuf) -> Result<PathBuf, NotRunnable> {
    use std::io::Read as _;
    let mut head = [0u8; 4];
    let Ok(n) = std::fs::File::open(&p).and_then(|mut f| f.read(&mut head)) else {
        return Ok(p);
    };
    let head = &head[..n];
    if head.starts_with(b"\x7fELF") || head.starts_with(b"#!") {
        Ok(p)
    } else {
        Err(NotRunnable::NotAProgram(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn not_found_is_127_not_executable_is_126_and_path_is_searched_in_order() {
        let root = std::env::temp_dir().join(format!("kvpn-runfind-{}", std::process::id()));
        let (a, b) = (root.join("a"), root.join("b"));
        std::fs::create_dir_all(&a).expect("mkdir");
        std::fs::create_dir_all(&b).expect("mkdir");
        let plain = a.join("run-me");
        std::fs::write(&plain, "").expect("write");
        let run = b.join("run-me");
        std::fs::write(&run, "#!/bin/sh\n").expect("write");
        {
            std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        let path = std::env::join_paths([&a, &b]).expect("PATH");
        let path = Some(path.as_os_str());
        // The first executable wins over an earlier plain file.
        assert_eq!(find_program("run-me", path), Ok(run.clone()));
        let missing = find_program("kvpn-no-such-command", path).expect_err("missing");
        assert_eq!(missing.exit_code(), 127);
        assert!(
            missing.to_string().contains("command not found"),
            "{missing}"
        );
        let e = find_program(plain.to_str().expect("utf-8"), None).expect_err("plain");
        assert_eq!(e, NotRunnable::NotExecutable(plain.clone()));
        assert_eq!(e.exit_code(), 126);
        assert_eq!(
            find_program(run.to_str().expect("utf-8"), None),
            Ok(run.clone())
        );
        // Executable but not a program (no ELF header, no #!): refused before
        // anything is connected, 126 like a shell's "exec format error".
        let junk = b.join("junk");
        std::fs::write(&junk, "just text\n").expect("write");
        {
            std::fs::set_permissions(&junk, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        let e = find_program(junk.to_str().expect("utf-8"), None).expect_err("junk ran");
        assert_eq!(e, NotRunnable::NotAProgram(junk.clone()));
        assert_eq!(e.exit_code(), 126);
        assert!(e.to_string().contains("exec format error"), "{e}");
        let elf = std::env::current_exe().expect("this test binary");
        assert_eq!(
            find_program(elf.to_str().expect("utf-8"), None),
            Ok(elf.clone())
        );
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    /// `kvpn lab exec laptop -- nosuchcmd` exits 127 and a file without execute
    /// permission 126, as in a shell (`ip netns exec` exits 1 for both, like a
    /// command that ran and failed).
    #[test]
    fn lab_exec_not_found_is_127_not_executable_is_126() {
        let dir = std::env::temp_dir().join(format!("kvpn-lab-exec-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let run = dir.join("run-me");
        std::fs::write(&run, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let plain = dir.join("plain");
        std::fs::write(&plain, "data").expect("write");
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let path = std::env::join_paths([Path::new("/nonexistent-kvpn"), &dir]).expect("PATH");
        let path = Some(path.as_os_str());

        assert_eq!(find_program("run-me", path), Ok(run.clone()));
        assert_eq!(
            find_program(run.to_str().expect("utf-8"), None),
            Ok(run.clone())
        );

        let e = find_program("nosuchcmd", path).expect_err("nosuchcmd found");
        assert_eq!(e.exit_code(), 127, "{e}");
        assert!(
            e.to_string().contains("nosuchcmd: command not found"),
            "{e}"
        );
        let e = find_program("/nonexistent-kvpn/x", path).expect_err("found");
        assert_eq!(e.exit_code(), 127, "{e}");
        assert_eq!(find_program("", path).map_err(|e| e.exit_code()), Err(127));

        let e = find_program("plain", path).expect_err("plain ran");
        assert_eq!(e, NotRunnable::NotExecutable(plain.clone()));
        assert_eq!(e.exit_code(), 126);
        let e = find_program(dir.to_str().expect("utf-8"), path).expect_err("folder ran");
        assert_eq!(e.exit_code(), 126, "{e}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
