//! The user's settings file, `<kvpn config folder>/config.yaml`
//! (`$XDG_CONFIG_HOME/kvpn/config.yaml`, else `~/.config/kvpn/config.yaml`; under
//! sudo the invoking user's: [`crate::kubeconfig::config_dir`]), and the choice of
//! the manager image and its pull settings for one connect.
//!
//! ```yaml
//! # every context
//! image: registry.example.com/kvpn/manager:0.1.0
//! imagePullSecrets: [regcred]
//! imagePullPolicy: IfNotPresent
//! contexts:
//!   kind-dev:                     # a kubeconfig context name
//!     image: localhost/kvpn/manager:0.1.0
//!     imagePullPolicy: Never
//! ```
//!
//! Precedence for each setting, first found wins: the flag (`--image`,
//! `--image-pull-secret`, `--image-pull-policy`), the environment (`KVPN_IMAGE`), the
//! file's entry for the context, the file's top level, what the installed manager
//! runs with (so a plain `kvpn connect` never rolls a custom image back), and the
//! default. [`choose`] is pure; [`load`] reads the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

/// The file's name in kvpn's config folder.
pub const FILE_NAME: &str = "config.yaml";
/// The environment variable naming the manager image.
pub const IMAGE_ENV: &str = "KVPN_IMAGE";

/// Install settings, at the top level or per context.
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct InstallSettings {
    pub image: Option<String>,
    pub image_pull_secrets: Option<Vec<String>>,
    pub image_pull_policy: Option<String>,
}

/// The whole file.
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Settings {
    pub image: Option<String>,
    pub image_pull_secrets: Option<Vec<String>>,
    pub image_pull_policy: Option<String>,
    #[serde(default)]
    pub contexts: BTreeMap<String, InstallSettings>,
}

#[derive(Debug, Error)]
pub enum SettingsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} is not a valid kvpn settings file: {message} — fix it (keys: image, imagePullSecrets, imagePullPolicy, contexts.<context>.<same keys>) or move it away",
        path.display()
    )]
    Parse { path: PathBuf, message: String },
}

/// Reads the settings file; a missing file is empty settings.
pub fn load(path: &Path) -> Result<Settings, SettingsError> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(path, &text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Settings::default()),
        Err(source) => Err(SettingsError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Parses the file's text (empty text is empty settings).
pub fn parse(path: &Path, text: &str) -> Result<Settings, SettingsError> {
    if text.trim().is_empty() {
        return Ok(Settings::default());
    }
    serde_yaml_ng::from_str(text).map_err(|e| SettingsError::Parse {
        path: path.to_owned(),
        // The location and what was expected; never the file's values (a
        // settings file is not secret, but the kubeconfig rule is kept).
        message: e.to_string(),
    })
}

/// Where a chosen value came from, for connect's output and `kvpn status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Flag(&'static str),
    Env(&'static str),
    File {
        path: PathBuf,
        context: Option<String>,
    },
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Flag(flag) => write!(f, "{flag}"),
            Origin::Env(var) => write!(f, "${var}"),
            Origin::File {
                path,
                context: Some(c),
            } => write!(f, "{} (context {c})", path.display()),
            Origin::File {
                path,
                context: None,
            } => write!(f, "{}", path.display()),
        }
    }
}

/// One setting that someone asked for, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen<T> {
    pub value: T,
    pub origin: Origin,
}

/// What a connect asks of the install; None = keep what the manager runs with
/// (or the default on a first install).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageChoice {
    pub image: Option<Chosen<String>>,
    pub pull_secrets: Option<Chosen<Vec<String>>>,
    pub pull_policy: Option<Chosen<String>>,
}

/// The flags and environment of one connect, as far as the image goes.
#[derive(Debug, Clone, Default)]
pub struct ImageFlags<'a> {
    pub image: Option<&'a str>,
    pub pull_secrets: &'a [String],
    pub pull_policy: Option<&'a str>,
    /// `$KVPN_IMAGE` of the user's environment.
    pub env_image: Option<&'a str>,
}

/// Applies the precedence in the module docs.
pub fn choose(
    flags: &ImageFlags<'_>,
    settings: &Settings,
    file: &Path,
    context: &str,
) -> ImageChoice {
    let ctx = settings.contexts.get(context);
    let file_origin = |in_context: bool| Origin::File {
        path: file.to_owned(),
        context: in_context.then(|| context.to_owned()),
    };
    let pick = |ctx_value: Option<String>, top: Option<String>| -> Option<Chosen<String>> {
        ctx_value
            .map(|value| Chosen {
                value,
                origin: file_origin(true),
            })
            .or_else(|| {
                top.map(|value| Chosen {
                    value,
                    origin: file_origin(false),
                })
            })
    };
    let image = flags
        .image
        .map(|v| Chosen {
            value: v.to_owned(),
            origin: Origin::Flag("--image"),
        })
        .or_else(|| {
            flags.env_image.filter(|v| !v.is_empty()).map(|v| Chosen {
                value: v.to_owned(),
                origin: Origin::Env(IMAGE_ENV),
            })
        })
        .or_else(|| pick(ctx.and_then(|c| c.image.clone()), settings.image.clone()));
    let pull_policy = flags
        .pull_policy
        .map(|v| Chosen {
            value: v.to_owned(),
            origin: Origin::Flag("--image-pull-policy"),
        })
        .or_else(|| {
            pick(
                ctx.and_then(|c| c.image_pull_policy.clone()),
                settings.image_pull_policy.clone(),
            )
        });
    let pull_secrets = if flags.pull_secrets.is_empty() {
        let in_ctx = ctx.and_then(|c| c.image_pull_secrets.clone());
        match in_ctx {
            Some(value) => Some(Chosen {
                value,
                origin: file_origin(true),
            }),
            None => settings.image_pull_secrets.clone().map(|value| Chosen {
                value,
                origin: file_origin(false),
            }),
        }
    } else {
        Some(Chosen {
            value: flags.pull_secrets.to_vec(),
            origin: Origin::Flag("--image-pull-secret"),
        })
    };
    ImageChoice {
        image,
        pull_secrets,
        pull_policy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "/home/a/.config/kvpn/config.yaml";

    fn settings(text: &str) -> Settings {
        parse(Path::new(FILE), text).expect("settings")
    }

    #[test]
    fn flag_beats_env_beats_context_beats_top_level() {
        let s = settings(
            "image: top/m:1\nimagePullPolicy: Always\ncontexts:\n  dev:\n    image: ctx/m:1\n    imagePullSecrets: [a, b]\n",
        );
        let file = Path::new(FILE);
        let flags = ImageFlags {
            image: Some("flag/m:1"),
            env_image: Some("env/m:1"),
            ..Default::default()
        };
        let c = choose(&flags, &s, file, "dev");
        assert_eq!(c.image.as_ref().map(|c| c.value.as_str()), Some("flag/m:1"));
        assert_eq!(c.image.map(|c| c.origin), Some(Origin::Flag("--image")));

        let flags = ImageFlags {
            env_image: Some("env/m:1"),
            ..Default::default()
        };
        let c = choose(&flags, &s, file, "dev");
        assert_eq!(c.image.map(|c| c.origin), Some(Origin::Env("KVPN_IMAGE")));

        let c = choose(&ImageFlags::default(), &s, file, "dev");
        let image = c.image.expect("image from the context");
        assert_eq!(image.value, "ctx/m:1");
        assert_eq!(image.origin.to_string(), format!("{FILE} (context dev)"));
        assert_eq!(
            c.pull_secrets.map(|c| c.value),
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(c.pull_policy.map(|c| c.value).as_deref(), Some("Always"));

        let c = choose(&ImageFlags::default(), &s, file, "other");
        assert_eq!(c.image.map(|c| c.value).as_deref(), Some("top/m:1"));
        assert_eq!(c.pull_secrets, None);
    }

    #[test]
    fn nothing_asked_keeps_the_installed_manager() {
        let c = choose(
            &ImageFlags::default(),
            &Settings::default(),
            Path::new(FILE),
            "x",
        );
        assert_eq!(c, ImageChoice::default());
    }

    #[test]
    fn an_unknown_key_is_refused_with_the_file_and_the_fix() {
        let e = parse(Path::new(FILE), "imgae: x\n").expect_err("typo");
        let msg = e.to_string();
        assert!(
            msg.contains(FILE) && msg.contains("imgae") && msg.contains("keys: image"),
            "{msg}"
        );
        assert_eq!(
            parse(Path::new(FILE), "  \n").expect("empty"),
            Settings::default()
        );
    }
}
