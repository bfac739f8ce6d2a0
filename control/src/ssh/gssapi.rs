//! Kerberos login to a jump host ([ssh] item 3): `gssapi-with-mic` (RFC 4462) with
//! russh's [`GssapiAuthenticator`] hook on one side and the system's MIT Kerberos
//! GSSAPI library (through `libgssapi`) on the other.
//!
//! Where the client's credentials come from, per hop:
//! - `--gssapi-password PW`: initial credentials for the principal `--ssh-username`
//!   with that password (`gss_acquire_cred_with_password`; the tickets live in a
//!   memory cache of this process and are never written to disk);
//! - `--gssapi-keytab PATH`: initial credentials for `--ssh-username` from the key
//!   in that keytab (`gss_acquire_cred_from` with `client_keytab`, a private memory
//!   cache);
//! - `--gssapi-cache PATH`: the tickets already in that credential cache (as
//!   `kinit -c PATH` leaves them; `gss_acquire_cred_from` with `ccache`);
//! - none of them: the default cache (the CLI's `KRB5CCNAME`, carried in the plan
//!   so the user daemon uses the same one; else the library's default), tried after
//!   every other method, and only when it holds credentials.
//!
//! A bare user name takes the default realm of krb5.conf (`user@REALM` names another
//! realm). The service is `host@<hop host>` (a host-based service name, like
//! OpenSSH's): the host exactly as the hop names it (its `--ssh-addr` host or its
//! config's HostName), which the library maps to `host/<host>@REALM`, canonicalising
//! the name only as krb5.conf's `dns_canonicalize_hostname` and `rdns` say (both
//! default to on in MIT: set them to `false` when the KDC knows the host by the name
//! you dial). The library reads krb5.conf (`KRB5_CONFIG`) for realms and KDCs.
//!
//! I/O: the GSSAPI calls talk to the KDC and read keytabs and caches; they run on
//! tokio's blocking pool.

use std::ffi::CString;
use std::path::PathBuf;
use std::ptr;

use libgssapi::context::{ClientCtx, CtxFlags, SecurityContext as _};
use libgssapi::credential::{Cred, CredUsage};
use libgssapi::name::Name;
use libgssapi::oid::{GSS_MECH_KRB5, GSS_NT_HOSTBASED_SERVICE, GSS_NT_USER_NAME, OidSet};
use russh::{GssapiAuthenticator, GssapiError, GssapiStep};
use serde::{Deserialize, Serialize};

use super::HopFlags;

/// The Kerberos 5 mechanism OID (1.2.840.113554.1.2.2), DER-encoded as
/// `gssapi-with-mic` carries it.
pub const KRB5_MECH_DER: &[u8] = &[
    0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x12, 0x01, 0x02, 0x02,
];

/// Where one hop's Kerberos credentials come from (one `--gssapi-*` flag).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Creds {
    Password(String),
    Keytab(PathBuf),
    Cache(PathBuf),
}

impl Creds {
    /// The `--gssapi-*` flag of a hop, if any (clap lets at most one through).
    pub fn from_flags(flags: &HopFlags) -> Option<Self> {
        if let Some(pw) = &flags.gssapi_password {
            return Some(Creds::Password(pw.clone()));
        }
        if let Some(k) = &flags.gssapi_keytab {
            return Some(Creds::Keytab(k.clone()));
        }
        flags.gssapi_cache.clone().map(Creds::Cache)
    }

    /// What the flag was, for messages (never the password).
    fn describe(&self) -> String {
        match self {
            Creds::Password(_) => "--gssapi-password".into(),
            Creds::Keytab(p) => format!("--gssapi-keytab {}", p.display()),
            Creds::Cache(p) => format!("--gssapi-cache {}", p.display()),
        }
    }

    /// What to check when these credentials fail.
    fn fix(&self) -> &'static str {
        match self {
            Creds::Password(_) => "check the password and that --ssh-username is the principal",
            Creds::Keytab(_) => {
                "check that the keytab holds a current key of the principal \
                 (`klist -k PATH`) and that --ssh-username names it"
            }
            Creds::Cache(_) => "renew the tickets (`kinit -c PATH`) and check `klist -c PATH`",
        }
    }
}

/// What to check when acquiring `creds` for `principal` failed with `cause`: the
/// library's minor status text decides (an unreachable KDC is no wrong password).
fn fix_for(creds: Option<&Creds>, principal: &str, cause: &str) -> String {
    let lower = cause.to_ascii_lowercase();
    let unreachable = [
        "cannot contact any kdc",
        "unable to reach any kdc",
        "cannot find kdc",
        "resource temporarily unavailable",
        "connection refused",
        "cannot resolve network address",
    ]
    .iter()
    .any(|s| lower.contains(s));
    if unreachable && matches!(creds, Some(Creds::Password(_) | Creds::Keytab(_))) {
        let realm = principal
            .rsplit_once('@')
            .map_or("the default realm", |(_, r)| r);
        return format!(
            "no KDC of realm {realm} could be reached: check the kdc lines of {realm} under \
             [realms] in krb5.conf (or the file KRB5_CONFIG names) and that the KDC answers"
        );
    }
    let bad_password = [
        "preauthentication failed",
        "password incorrect",
        "integrity check",
    ]
    .iter()
    .any(|s| lower.contains(s));
    match creds {
        Some(Creds::Password(_)) if bad_password => {
            "the password is wrong for this principal — check it and that --ssh-username \
             is the principal"
                .into()
        }
        Some(c) => c.fix().into(),
        None => "run `kinit` or pass a --gssapi-* flag".into(),
    }
}

/// A Kerberos failure: the principal (or cache), where the credentials came from,
/// the library's cause and what to check.
#[derive(Debug, Clone, thiserror::Error)]
#[error("Kerberos credentials for {principal} ({source_flag}): {cause} — {fix}")]
pub struct KrbError {
    pub principal: String,
    pub source_flag: String,
    pub cause: String,
    pub fix: String,
}

/// Kerberos credentials acquired for one hop, ready for [`Login::new`].
pub struct Acquired {
    cred: Cred,
    /// `user@REALM` (or the cache's principal), for messages.
    pub principal: String,
}

/// Acquires the credentials `creds` for `user`, or when `None` those of the default
/// cache: `default_ccache` (a cache name like `FILE:/tmp/krb5cc_1000`), else the
/// library's default. Blocking: talks to the KDC for a password, reads keytabs and
/// caches.
pub fn acquire(
    creds: Option<&Creds>,
    default_ccache: Option<&str>,
    user: &str,
) -> Result<Acquired, KrbError> {
    let source_flag = creds.map_or_else(
        || match default_ccache {
            Some(c) => format!("the default credential cache {c}"),
            None => "the default credential cache".into(),
        },
        Creds::describe,
    );
    // `user@REALM` as the library reads `user` (the default realm of krb5.conf).
    let full = Name::new(user.as_bytes(), Some(GSS_NT_USER_NAME))
        .and_then(|n| n.canonicalize(Some(GSS_MECH_KRB5)))
        .map(|n| n.to_string())
        .unwrap_or_else(|_| user.to_owned());
    let user_principal = full.as_str();
    let fail = |principal: &str, cause: String| KrbError {
        principal: principal.to_owned(),
        source_flag: source_flag.clone(),
        fix: fix_for(creds, user_principal, &cause),
        cause,
    };
    if let Some(Creds::Keytab(path)) = creds {
        // The library says only "No credentials cache found" for a missing keytab.
        if let Err(e) = std::fs::File::open(path) {
            return Err(KrbError {
                principal: user_principal.to_owned(),
                source_flag: source_flag.clone(),
                cause: if e.kind() == std::io::ErrorKind::NotFound {
                    format!("the keytab {} does not exist", path.display())
                } else {
                    format!("cannot read the keytab {}: {e}", path.display())
                },
                fix: "give the path of a keytab readable by you (`klist -k PATH` lists it)".into(),
            });
        }
    }
    let krb5_only =
        OidSet::singleton(GSS_MECH_KRB5).map_err(|e| fail(user_principal, e.to_string()))?;
    let cred = match creds {
        None => match default_ccache {
            Some(c) => acquire_from(None, &[("ccache", c.to_owned())])
                .map_err(|e| fail("the default principal", e))?,
            None => Cred::acquire(None, None, CredUsage::Initiate, Some(&krb5_only))
                .map_err(|e| fail("the default principal", e.to_string()))?,
        },
        Some(Creds::Password(pw)) => {
            let name = Name::new(user.as_bytes(), Some(GSS_NT_USER_NAME))
                .map_err(|e| fail(user_principal, e.to_string()))?;
            Cred::acquire_with_password(
                Some(&name),
                pw,
                None,
                CredUsage::Initiate,
                Some(&krb5_only),
            )
            .map_err(|e| fail(user_principal, e.to_string()))?
        }
        Some(Creds::Keytab(path)) => {
            // A memory cache of this process only: the user's own cache is left alone.
            let ccache = format!("MEMORY:kvpn-{}-{}", std::process::id(), next_cache_id());
            let store = [
                ("client_keytab", format!("FILE:{}", path.display())),
                ("ccache", ccache),
            ];
            acquire_from(Some(user), &store).map_err(|e| fail(user_principal, e))?
        }
        Some(Creds::Cache(path)) => {
            let store = [("ccache", format!("FILE:{}", path.display()))];
            acquire_from(None, &store)
                .map_err(|e| fail(&format!("the principal of {}", path.display()), e))?
        }
    };
    let principal = cred.name().map(|n| n.to_string()).unwrap_or(full);
    Ok(Acquired { cred, principal })
}

fn next_cache_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `gss_acquire_cred_from` (MIT's credential store extension, which `libgssapi`
/// does not wrap) for initiator credentials of `user` (or the store's default
/// principal) with the store's `key = value` elements.
fn acquire_from(user: Option<&str>, store: &[(&str, String)]) -> Result<Cred, String> {
    use libgssapi_sys as sys;
    let to_c = |s: &str| CString::new(s).map_err(|_| format!("{s:?} contains a NUL byte"));
    let pairs = store
        .iter()
        .map(|(k, v)| Ok((to_c(k)?, to_c(v)?)))
        .collect::<Result<Vec<_>, String>>()?;
    let mut elements: Vec<sys::gss_key_value_element_desc> = pairs
        .iter()
        .map(|(k, v)| sys::gss_key_value_element_desc {
            key: k.as_ptr(),
            value: v.as_ptr(),
        })
        .collect();
    let set = sys::gss_key_value_set_desc {
        count: u32::try_from(elements.len()).unwrap_or(0),
        elements: elements.as_mut_ptr(),
    };
    let mut minor: sys::OM_uint32 = 0;
    let mut name: sys::gss_name_t = ptr::null_mut();
    if let Some(user) = user {
        let mut buf = sys::gss_buffer_desc {
            length: user.len(),
            value: user.as_ptr().cast_mut().cast(),
        };
        // SAFETY: `buf` points at `user`'s bytes for the call (import copies them);
        // GSS_C_NT_USER_NAME is the library's static OID; `name` receives a new name
        // released below.
        let major = unsafe {
            sys::gss_import_name(&mut minor, &mut buf, sys::GSS_C_NT_USER_NAME, &mut name)
        };
        if major != sys::GSS_S_COMPLETE {
            return Err(gss_error(major, minor));
        }
    }
    let mut cred: sys::gss_cred_id_t = ptr::null_mut();
    // SAFETY: every pointer is valid for the call: `name` (or GSS_C_NO_NAME), the
    // store set whose strings `pairs` keeps alive, and the out-parameter `cred`;
    // a null desired mechanism set and null actual_mechs/time_rec are allowed.
    let major = unsafe {
        sys::gss_acquire_cred_from(
            &mut minor,
            name,
            u32::MAX, // GSS_C_INDEFINITE
            ptr::null_mut(),
            sys::GSS_C_INITIATE as sys::gss_cred_usage_t,
            &set,
            &mut cred,
            ptr::null_mut(),
            ptr::null_mut(),
        )
    };
    if !name.is_null() {
        let mut m = 0;
        // SAFETY: `name` came from gss_import_name above and is released once.
        unsafe { sys::gss_release_name(&mut m, &mut name) };
    }
    if major != sys::GSS_S_COMPLETE {
        return Err(gss_error(major, minor));
    }
    // SAFETY: `cred` is a new credential this call owns; the Cred takes it over.
    Ok(unsafe { Cred::from_c(cred) })
}

/// The library's text for a status pair.
fn gss_error(major: u32, minor: u32) -> String {
    libgssapi::error::Error {
        major: libgssapi::error::MajorFlags::from_bits_retain(major),
        minor,
    }
    .to_string()
}

/// A failure during the context exchange with the SSH server.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("the SSH connection closed during the Kerberos exchange")]
    Send(#[from] russh::SendError),
    #[error("{0}")]
    Gss(String),
}

/// One `gssapi-with-mic` login: the security context to `host@<host>` and what the
/// server reported.
pub struct Login {
    ctx: Option<ClientCtx>,
    target: String,
    /// The server's `SSH_MSG_USERAUTH_GSSAPI_ERROR` text, if it sent one.
    pub server_error: Option<String>,
}

impl Login {
    /// A context for the SSH service on `host` with `acquired`'s credentials.
    pub fn new(acquired: &Acquired, host: &str) -> Result<Self, String> {
        let target = format!("host@{host}");
        let name = Name::new(target.as_bytes(), Some(GSS_NT_HOSTBASED_SERVICE))
            .map_err(|e| format!("service name {target}: {e}"))?;
        let ctx = ClientCtx::new(
            Some(acquired.cred.clone()),
            name,
            CtxFlags::GSS_C_MUTUAL_FLAG | CtxFlags::GSS_C_INTEG_FLAG,
            Some(GSS_MECH_KRB5),
        );
        Ok(Login {
            ctx: Some(ctx),
            target,
            server_error: None,
        })
    }
}

impl GssapiAuthenticator for Login {
    type Error = StepError;

    async fn gssapi_step(
        &mut self,
        selected_mechanism: Option<Vec<u8>>,
        input_token: Option<Vec<u8>>,
        mic_data: Vec<u8>,
    ) -> Result<GssapiStep, StepError> {
        if let Some(m) = selected_mechanism
            && m != KRB5_MECH_DER
        {
            return Err(StepError::Gss(format!(
                "the server chose a GSSAPI mechanism kvpn did not offer ({})",
                data_encoding::HEXLOWER.encode(&m)
            )));
        }
        let mut ctx = self
            .ctx
            .take()
            .ok_or_else(|| StepError::Gss("the Kerberos context failed before".into()))?;
        let target = self.target.clone();
        // init_sec_context asks the KDC for a service ticket on the first step.
        let (ctx, step) = tokio::task::spawn_blocking(move || {
            let step = (|| {
                let out = ctx
                    .step(input_token.as_deref(), None)
                    .map_err(|e| format!("service ticket for {target}: {e}"))?
                    .map(|b| b.to_vec());
                if !ctx.is_complete() {
                    return Ok(GssapiStep::Continue {
                        token: out.unwrap_or_default(),
                    });
                }
                let mic = ctx
                    .get_mic(&mic_data)
                    .map_err(|e| format!("MIC for {target}: {e}"))?;
                Ok(GssapiStep::Complete {
                    token: out,
                    mic: Some(mic.to_vec()),
                })
            })();
            (ctx, step)
        })
        .await
        .map_err(|e| StepError::Gss(format!("the Kerberos step did not finish: {e}")))?;
        self.ctx = Some(ctx);
        step.map_err(StepError::Gss)
    }

    async fn gssapi_error(&mut self, error: GssapiError) {
        if let GssapiError::Status { message, .. } = error {
            self.server_error = Some(message);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_krb5_mechanism_oid_is_the_der_of_1_2_840_113554_1_2_2() {
        // GSS_MECH_KRB5 holds the OID's content octets; the wire form adds tag and length.
        let body: &[u8] = &GSS_MECH_KRB5;
        assert_eq!(&KRB5_MECH_DER[2..], body);
        assert_eq!(
            KRB5_MECH_DER[..2],
            [0x06, u8::try_from(body.len()).unwrap_or(0)]
        );
    }

    #[test]
    fn a_keytab_that_does_not_exist_is_named_before_gssapi_is_asked() {
        let path = PathBuf::from("/nonexistent/kvpn-user.keytab");
        let e = acquire(Some(&Creds::Keytab(path)), None, "root")
            .err()
            .expect("no keytab, no credentials");
        let text = e.to_string();
        assert!(
            text.contains("the keytab /nonexistent/kvpn-user.keytab does not exist"),
            "{text}"
        );
        assert!(!text.contains("No credentials cache"), "{text}");
    }

    #[test]
    fn the_kerberos_hint_follows_the_cause_not_the_flag() {
        let pw = Creds::Password("x".into());
        let unreachable = fix_for(
            Some(&pw),
            "alice@LAB.KVPN",
            "Cannot contact any KDC for realm 'LAB.KVPN' (Resource temporarily unavailable)",
        );
        assert!(unreachable.contains("realm LAB.KVPN"), "{unreachable}");
        assert!(unreachable.contains("KRB5_CONFIG"), "{unreachable}");
        assert!(!unreachable.contains("password"), "{unreachable}");
        let wrong = fix_for(Some(&pw), "alice@LAB.KVPN", "Preauthentication failed");
        assert!(wrong.contains("password is wrong"), "{wrong}");
        let cache = fix_for(
            Some(&Creds::Cache("/t/cc".into())),
            "p@R",
            "No credentials cache found",
        );
        assert!(cache.contains("kinit -c PATH"), "{cache}");
    }

    #[test]
    fn a_cache_that_does_not_exist_names_kerberos_the_cache_and_the_fix() {
        let path = PathBuf::from("/nonexistent/kvpn-krb5cc");
        let e = acquire(Some(&Creds::Cache(path)), None, "root")
            .err()
            .expect("no cache, no credentials");
        let text = e.to_string();
        assert!(
            text.starts_with("Kerberos credentials for the principal of /nonexistent/kvpn-krb5cc"),
            "{text}"
        );
        assert!(text.contains("--gssapi-cache"), "{text}");
        assert!(text.contains("kinit -c PATH"), "{text}");
    }
}
