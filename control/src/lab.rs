//! `kvpn lab`: the built-in lab (a cluster in network namespaces) for trying
//! kvpn out. The lab itself lives in the kvpn-lab crate (lab-only code); this is
//! its command-line face. The lab is persistent between commands: `up` records
//! it under a name, `exec`/`info`/`down` find it by that name.

use anyhow::{Context, Result, anyhow};
use kvpn_lab::{DEFAULT_LAB_NAME, Lab, LabOptions};

use crate::cli::LabCommand;
use crate::output;

/// Run a `kvpn lab` subcommand.
pub async fn run(cmd: LabCommand) -> Result<()> {
    tokio::task::spawn_blocking(move || run_blocking(cmd))
        .await
        .context("lab task panicked")?
}

fn run_blocking(cmd: LabCommand) -> Result<()> {
    match cmd {
        LabCommand::Up => {
            output::step("Bringing the lab up: laptop, node and pod network namespaces, ClusterIP rules, manager and backend pods");
            let lab = Lab::up(LabOptions::default().persist_as(DEFAULT_LAB_NAME))
                .context("kvpn lab up failed")?;
            output::info_block(&lab.info());
            let state = lab.detach().context("cannot record the lab's state")?;
            output::done(&format!(
                "Lab {DEFAULT_LAB_NAME} is up (state {}); run commands in it with `kvpn lab exec laptop -- <cmd>`, remove it with `kvpn lab down`",
                state.display()
            ));
            Ok(())
        }
        LabCommand::Down => {
            output::step(&format!("Tearing the lab {DEFAULT_LAB_NAME} down"));
            if kvpn_lab::down_named(DEFAULT_LAB_NAME).context("kvpn lab down failed")? {
                output::done("Lab is down: its processes, network namespaces and nftables rules are gone");
            } else {
                output::done(&format!("No lab named {DEFAULT_LAB_NAME} was up"));
            }
            Ok(())
        }
        LabCommand::Info => {
            let lab = Lab::attach(DEFAULT_LAB_NAME).context("no lab to describe — bring one up with `kvpn lab up`")?;
            output::info_block(&lab.info());
            Ok(())
        }
        LabCommand::Exec { role, command } => {
            let lab = Lab::attach(DEFAULT_LAB_NAME).context("no lab to run in — bring one up with `kvpn lab up`")?;
            let (program, args) = command
                .split_first()
                .ok_or_else(|| anyhow!("kvpn lab exec {role}: no command given — e.g. `kvpn lab exec laptop -- curl http://10.244.1.11:8080/`"))?;
            let status = lab
                .command_in(&role, program)
                .with_context(|| format!("kvpn lab exec: unknown role {role:?} (laptop, node, or a pod name from `kvpn lab info`)"))?
                .args(args)
                .status()
                .with_context(|| format!("cannot run {program:?} in the lab's {role} namespace"))?;
            // Hand the command's own exit code back, like `ip netns exec` does.
            std::process::exit(status.code().unwrap_or(1));
        }
    }
}
