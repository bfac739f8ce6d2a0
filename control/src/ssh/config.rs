//! The SSH config file (`~/.ssh/config` or `--ssh-config`), read with the
//! `ssh2-config` crate: Host blocks with HostName, User, Port, IdentityFile and
//! ProxyJump (Include works; Match blocks do not). I/O: reading the file once.

use std::path::{Path, PathBuf};

use ssh2_config::{ParseRule, SshConfig};

use super::{Error, HostEntry, HostLookup};

/// A parsed SSH config file.
pub struct FileConfig {
    path: PathBuf,
    config: SshConfig,
}

impl FileConfig {
    /// Reads and parses `path`; `~` in it expands to `home`. Options kvpn does not
    /// use are accepted and ignored.
    pub fn read(path: &Path, home: Option<&Path>) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Config {
            path: path.to_owned(),
            why: format!("cannot read it: {e}"),
        })?;
        Self::parse(path, &text, home)
    }

    /// Parses `text` (the content of `path`).
    pub fn parse(path: &Path, text: &str, home: Option<&Path>) -> Result<Self, Error> {
        let mut config = SshConfig::default();
        if let Some(h) = home {
            config = config.home_dir(h);
        }
        let mut reader = std::io::BufReader::new(text.as_bytes());
        let config = config
            .parse(
                &mut reader,
                ParseRule::ALLOW_UNKNOWN_FIELDS | ParseRule::ALLOW_UNSUPPORTED_FIELDS,
            )
            .map_err(|e| Error::Config {
                path: path.to_owned(),
                why: e.to_string(),
            })?;
        Ok(FileConfig {
            path: path.to_owned(),
            config,
        })
    }
}

impl HostLookup for FileConfig {
    fn lookup(&self, name: &str) -> HostEntry {
        let p = self.config.query(name);
        HostEntry {
            host_name: p.host_name,
            user: p.user,
            port: p.port,
            identity_files: p.identity_file.unwrap_or_default(),
            proxy_jump: p.proxy_jump,
        }
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ssh::{HopFlags, resolve_hops};

    #[test]
    fn ssh_01_a_real_config_file_with_a_three_hop_chain() {
        let text = "\
Host target
    HostName 10.3.0.2
    Port 2203
    User t
    ProxyJump b2
    IdentityFile ~/.ssh/target_key

Host b2
    HostName 10.2.0.2
    Port 2202
    ProxyJump b1

Host b1
    HostName 10.1.0.2
    User u1
    Port 2201
    IdentityFile /keys/b1
    ServerAliveInterval 15

Host *
    User everyone
";
        let cfg = FileConfig::parse(Path::new("/t/config"), text, Some(Path::new("/home/a")))
            .expect("parse");
        let flags = HopFlags {
            ssh_alias: Some("target".into()),
            ..Default::default()
        };
        let hops = resolve_hops(&flags, &cfg, Some("me")).expect("chain");
        let got: Vec<String> = hops
            .iter()
            .map(|h| format!("{}@{}:{}", h.user, h.host, h.port))
            .collect();
        assert_eq!(
            got,
            [
                "u1@10.1.0.2:2201",
                "everyone@10.2.0.2:2202",
                "t@10.3.0.2:2203"
            ]
        );
        assert_eq!(hops[0].identity_files, [PathBuf::from("/keys/b1")]);
        assert_eq!(
            hops[2].identity_files,
            [PathBuf::from("/home/a/.ssh/target_key")]
        );
    }

    #[test]
    fn a_cycle_in_a_real_config_file_is_refused() {
        let text = "Host a\n  HostName 10.0.0.1\n  ProxyJump b\nHost b\n  HostName 10.0.0.2\n  ProxyJump a\n";
        let cfg = FileConfig::parse(Path::new("/t/config"), text, None).expect("parse");
        let flags = HopFlags {
            ssh_alias: Some("a".into()),
            ..Default::default()
        };
        let e = resolve_hops(&flags, &cfg, Some("me")).expect_err("cycle");
        assert!(e.to_string().contains("a -> b -> a"), "{e}");
        assert!(e.to_string().contains("/t/config"), "{e}");
    }
}
