//! The SSH config file (`~/.ssh/config` or `--ssh-config`), read with the
//! `ssh2-config` crate: Host blocks with HostName, User, Port, IdentityFile and
//! ProxyJump, and UserKnownHostsFile (Include works; Match blocks do not). I/O: reading the file once.

use std::path::{Path, PathBuf};

use ssh2_config::{ParseRule, SshConfig};

use super::{Error, HostEntry, HostLookup};

/// A parsed SSH config file.
pub struct FileConfig {
    path: PathBuf,
    config: SshConfig,
    /// For `~` in UserKnownHostsFile (the crate keeps that option unparsed).
    home: Option<PathBuf>,
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
            home: home.map(Path::to_path_buf),
        })
    }
}

/// `~` and `~/…` against `home` (as OpenSSH does for file options).
fn expand_home(path: &str, home: Option<&Path>) -> PathBuf {
    match (path.strip_prefix('~'), home) {
        (Some(""), Some(h)) => h.to_path_buf(),
        (Some(rest), Some(h)) if rest.starts_with('/') => h.join(rest.trim_start_matches('/')),
        _ => PathBuf::from(path),
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
            known_hosts: p
                .unsupported_fields
                .get("userknownhostsfile")
                .and_then(|files| files.first())
                .map(|f| expand_home(f, self.home.as_deref())),
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

    /// `UserKnownHostsFile` in ssh_config is the known_hosts file, as OpenSSH
    /// reads it (`~` expanded, the first of several, `Host *` too);
    /// `--ssh-known-hosts` still wins.
    #[test]
    fn user_known_hosts_file_in_ssh_config_is_honoured() {
        let text = "\
Host bastion
    HostName 10.1.0.2
    UserKnownHostsFile ~/.ssh/corp_known_hosts /etc/other

Host *
    UserKnownHostsFile /srv/all_known_hosts
";
        let dir = std::env::temp_dir().join(format!("kvpn-ukh-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("config");
        std::fs::write(&path, text).expect("write config");
        let home = Path::new("/home/a");
        let cfg = FileConfig::parse(&path, text, Some(home)).expect("parse");
        assert_eq!(
            cfg.lookup("bastion").known_hosts,
            Some(PathBuf::from("/home/a/.ssh/corp_known_hosts"))
        );
        assert_eq!(
            cfg.lookup("other").known_hosts,
            Some(PathBuf::from("/srv/all_known_hosts"))
        );
        let mut args = crate::ssh::SshArgs {
            ssh_config: Some(path.clone()),
            ..Default::default()
        };
        args.hop.ssh_alias = Some("bastion".into());
        let plan = crate::ssh::resolve_plan(&args, Some(home), Some("me"))
            .expect("plan")
            .expect("an SSH plan");
        assert_eq!(
            plan.known_hosts,
            PathBuf::from("/home/a/.ssh/corp_known_hosts")
        );
        args.ssh_known_hosts = Some("/flag/kh".into());
        let plan = crate::ssh::resolve_plan(&args, Some(home), Some("me"))
            .expect("plan")
            .expect("an SSH plan");
        assert_eq!(plan.known_hosts, PathBuf::from("/flag/kh"), "the flag wins");
        let _ = std::fs::remove_dir_all(&dir);
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
