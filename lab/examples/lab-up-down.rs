//! Brings a lab up, prints what runs where and how long up and down took, and tears
//! it down: `cargo run -p kvpn-lab --example lab-up-down [-- --with-manager]` (root).

use std::time::Instant;

use kvpn_lab::{Lab, LabOptions};

fn main() -> Result<(), kvpn_lab::LabError> {
    let with_manager = std::env::args().any(|a| a == "--with-manager");
    let options = if with_manager {
        LabOptions::default()
    } else {
        LabOptions::default().without_manager()
    };
    let started = Instant::now();
    let mut lab = Lab::up(options)?;
    let up = started.elapsed();
    eprint!("{}", lab.info());
    let started = Instant::now();
    lab.down()?;
    eprintln!(
        "lab up {:.3} s, down {:.3} s",
        up.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
