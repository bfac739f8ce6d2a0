//! Kubeconfig files for the lab cluster: one cluster, one client-certificate
//! user, one context. Pure: renders YAML text; file paths inside are absolute,
//! so the file works from any directory while the lab folder exists.

use std::path::Path;

/// One kubeconfig: `user` authenticates with a client certificate.
#[derive(Debug, Clone)]
pub struct KubeconfigSpec<'a> {
    /// Cluster name, unique per lab instance (kubeconfigs may be merged).
    pub cluster: &'a str,
    /// `https://ip:port`
    pub server: &'a str,
    pub ca_file: &'a Path,
    pub user: &'a str,
    pub client_cert_file: &'a Path,
    pub client_key_file: &'a Path,
    /// The context's default namespace.
    pub namespace: Option<&'a str>,
}

/// A YAML double-quoted scalar (JSON's string syntax is valid YAML).
fn quoted(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

fn path_str(p: &Path) -> String {
    quoted(&p.to_string_lossy())
}

/// The kubeconfig text.
pub fn render(spec: &KubeconfigSpec<'_>) -> String {
    let context = format!("{}@{}", spec.user, spec.cluster);
    let namespace = spec
        .namespace
        .map(|ns| format!("    namespace: {}\n", quoted(ns)))
        .unwrap_or_default();
    format!(
        "apiVersion: v1\n\
         kind: Config\n\
         clusters:\n\
         - name: {cluster}\n\
         \x20 cluster:\n\
         \x20   server: {server}\n\
         \x20   certificate-authority: {ca}\n\
         users:\n\
         - name: {user}\n\
         \x20 user:\n\
         \x20   client-certificate: {cert}\n\
         \x20   client-key: {key}\n\
         contexts:\n\
         - name: {context}\n\
         \x20 context:\n\
         \x20   cluster: {cluster}\n\
         \x20   user: {user}\n\
         {namespace}\
         current-context: {context}\n",
        cluster = quoted(spec.cluster),
        server = quoted(spec.server),
        ca = path_str(spec.ca_file),
        user = quoted(spec.user),
        cert = path_str(spec.client_cert_file),
        key = path_str(spec.client_key_file),
        context = quoted(&context),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_field_quoted() {
        let text = render(&KubeconfigSpec {
            cluster: "kvpn-lab-abcde",
            server: "https://127.1.2.3:6443",
            ca_file: Path::new("/tmp/lab dir/pki/ca.crt"),
            user: "kvpn-user",
            client_cert_file: Path::new("/tmp/lab dir/pki/kvpn-user.crt"),
            client_key_file: Path::new("/tmp/lab dir/pki/kvpn-user.key"),
            namespace: Some("kvpn-system"),
        });
        assert!(
            text.contains("    server: \"https://127.1.2.3:6443\"\n"),
            "{text}"
        );
        assert!(
            text.contains("    certificate-authority: \"/tmp/lab dir/pki/ca.crt\"\n"),
            "{text}"
        );
        assert!(text.contains("    namespace: \"kvpn-system\"\n"), "{text}");
        assert!(
            text.ends_with("current-context: \"kvpn-user@kvpn-lab-abcde\"\n"),
            "{text}"
        );
    }
}
