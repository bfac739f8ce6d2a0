//! A real MIT Kerberos KDC (Debian's krb5-kdc) for the GSSAPI SSH tests: realm
//! [`REALM`], its database, stash, config files, keytabs and log in a test folder
//! (never /etc: `KRB5_CONFIG` and `KRB5_KDC_PROFILE` point every Kerberos program at
//! them), the `krb5kdc` process inside the lab's laptop netns on its loopback
//! (127.0.0.1:[`KDC_PORT`], UDP and TCP), where kvpn — the only Kerberos client —
//! runs. Principals are made with `kadmin.local`, keys exported with `ktadd`, tickets
//! fetched with `kinit`. The KDC (by pid) stops on drop; the files go with the
//! lab's folder.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpn_lab::Netns;

use crate::ssh_lab::run;
use crate::text;

/// The lab's realm.
pub const REALM: &str = "KVPN.TEST";
/// The KDC's port on the laptop netns' loopback.
pub const KDC_PORT: u16 = 8888;
/// The master key of the KDC database (stashed, never typed).
const MASTER: &str = "kvpn-lab-kdc-master";

/// A running KDC and its files.
pub struct Kdc {
    /// Its folder: kdc.conf, krb5.conf, database, keytabs, log.
    pub dir: PathBuf,
    /// The client config (`KRB5_CONFIG` for kvpn, kinit and sshd).
    pub krb5_conf: PathBuf,
    kdc_conf: PathBuf,
    kdc: Option<Child>,
}

impl Kdc {
    /// Creates the realm's database in `dir` and starts `krb5kdc` in `netns`.
    pub fn start(dir: &Path, netns: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let d = dir.display();
        let kdc_conf = dir.join("kdc.conf");
        std::fs::write(
            &kdc_conf,
            format!(
                "[kdcdefaults]\n kdc_ports = {KDC_PORT}\n kdc_tcp_ports = {KDC_PORT}\n\
                 [realms]\n {REALM} = {{\n  database_name = {d}/principal\n  \
                 key_stash_file = {d}/stash\n  acl_file = {d}/kadm5.acl\n  \
                 kdc_ports = {KDC_PORT}\n  kdc_tcp_ports = {KDC_PORT}\n  \
                 max_life = 1h\n }}\n[logging]\n kdc = FILE:{d}/kdc.log\n"
            ),
        )
        .unwrap_or_else(|e| panic!("kdc.conf: {e}"));
        std::fs::write(dir.join("kadm5.acl"), "").unwrap_or_else(|e| panic!("acl: {e}"));
        // Clients reach the KDC by address and never canonicalise host names.
        let krb5_conf = dir.join("krb5.conf");
        std::fs::write(
            &krb5_conf,
            format!(
                "[libdefaults]\n default_realm = {REALM}\n dns_lookup_kdc = false\n \
                 dns_lookup_realm = false\n dns_canonicalize_hostname = false\n rdns = false\n\
                 [realms]\n {REALM} = {{\n  kdc = 127.0.0.1:{KDC_PORT}\n }}\n"
            ),
        )
        .unwrap_or_else(|e| panic!("krb5.conf: {e}"));
        let mut kdc = Kdc {
            dir: dir.to_owned(),
            krb5_conf,
            kdc_conf,
            kdc: None,
        };
        run(kdc
            .cmd("kdb5_util")
            .args(["create", "-s", "-r", REALM, "-P", MASTER]));
        let ns = Netns::from_name(netns);
        ns.ip(&["link", "set", "lo", "up"])
            .unwrap_or_else(|e| panic!("lo up in {netns}: {e:#}"));
        let mut cmd = ns.command("krb5kdc");
        cmd.arg("-n")
            .env("KRB5_CONFIG", &kdc.krb5_conf)
            .env("KRB5_KDC_PROFILE", &kdc.kdc_conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("krb5kdc.stderr"))
                    .unwrap_or_else(|e| panic!("krb5kdc stderr: {e}")),
            ));
        kdc.kdc = Some(cmd.spawn().unwrap_or_else(|e| panic!("krb5kdc: {e}")));
        // Listening once the log says so (it logs after binding its sockets).
        let t0 = Instant::now();
        while !kdc.log().contains("commencing operation") {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "krb5kdc never started:\n{}\n{}",
                kdc.log(),
                std::fs::read_to_string(dir.join("krb5kdc.stderr")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        kdc
    }

    /// A Kerberos admin command with this realm's config.
    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("KRB5_CONFIG", &self.krb5_conf)
            .env("KRB5_KDC_PROFILE", &self.kdc_conf)
            .stdin(Stdio::null());
        c
    }

    /// `kadmin.local -q <query>`; fails the test unless it worked (kadmin.local
    /// exits 0 also when the query fails, so its stderr is checked too).
    pub fn kadmin(&self, query: &str) {
        let out = run(self.cmd("kadmin.local").args(["-r", REALM, "-q", query]));
        let err = text(&out.stderr);
        assert!(
            !err.contains("rror") && !err.contains("failed"),
            "kadmin.local -q {query:?}: {err}"
        );
    }

    /// Adds the user principal `name@REALM` with `password`.
    pub fn add_user(&self, name: &str, password: &str) {
        self.kadmin(&format!("addprinc -pw {password} {name}"));
    }

    /// Adds `host/<host>@REALM` with a random key and exports it to a new keytab
    /// (sshd's `KRB5_KTNAME`); returns the keytab.
    pub fn add_host(&self, host: &str) -> PathBuf {
        let kt = self.dir.join(format!("host-{host}.keytab"));
        self.kadmin(&format!("addprinc -randkey host/{host}"));
        self.kadmin(&format!("ktadd -k {} host/{host}", kt.display()));
        kt
    }

    /// Exports `name`'s current keys (the password stays valid) to a new keytab.
    pub fn user_keytab(&self, name: &str) -> PathBuf {
        let kt = self.dir.join(format!("{name}.keytab"));
        self.kadmin(&format!("ktadd -k {} -norandkey {name}", kt.display()));
        kt
    }

    /// `kinit` for `name` with `password` (in `netns`, where the KDC is) into the
    /// credential cache file `ccache`.
    pub fn kinit(&self, netns: &str, name: &str, password: &str, ccache: &Path) {
        let mut cmd = Netns::from_name(netns).command("kinit");
        cmd.arg("-c")
            .arg(ccache)
            .arg(name)
            .env("KRB5_CONFIG", &self.krb5_conf)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("kinit: {e}"));
        if let Some(mut stdin) = child.stdin.take() {
            use std::io::Write as _;
            stdin
                .write_all(format!("{password}\n").as_bytes())
                .unwrap_or_else(|e| panic!("kinit stdin: {e}"));
        }
        let out = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("kinit: {e}"));
        assert!(
            out.status.success(),
            "kinit {name}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }

    /// The KDC's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("kdc.log")).unwrap_or_default()
    }
}

impl Drop for Kdc {
    fn drop(&mut self) {
        if let Some(mut c) = self.kdc.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
