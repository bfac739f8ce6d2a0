//! `kvpn-soak [--seconds N] [--rate R] [--json PATH]`: the bounded soak on the
//! Kubernetes lab (kvpn_tests::soak). Prints the summary table on stdout and
//! the JSON report to PATH (or after the table); exits 1 when a bound was
//! broken or a request hung, 2 on bad arguments. Run it as root with
//! KVPN_BIN_DIR naming the kvpn binaries (`./x soak` does both).
#![allow(clippy::print_stdout, reason = "the report goes to stdout")]

use std::time::Duration;

use kvpn_tests::soak::{self, Options};

fn usage(msg: &str) -> ! {
    eprintln!(
        "kvpn-soak: {msg}\nusage: kvpn-soak [--seconds N (default 600)] [--rate REQ_PER_S_PER_KIND (default 4)] [--json PATH]"
    );
    std::process::exit(2)
}

fn main() {
    let mut opts = Options::default();
    let mut json_path = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .unwrap_or_else(|| usage(&format!("{name} needs a value")))
        };
        match a.as_str() {
            "--seconds" => {
                let v = value("--seconds");
                let secs: u64 = v
                    .parse()
                    .unwrap_or_else(|_| usage(&format!("--seconds {v}: not a whole number")));
                if secs < 30 {
                    usage("--seconds must be at least 30 (three faults and two checkpoints)");
                }
                opts.duration = Duration::from_secs(secs);
            }
            "--rate" => {
                let v = value("--rate");
                opts.rate = v
                    .parse()
                    .ok()
                    .filter(|r: &f64| *r > 0.0 && *r <= 50.0)
                    .unwrap_or_else(|| usage(&format!("--rate {v}: a number in (0, 50]")));
            }
            "--json" => json_path = Some(value("--json")),
            "-h" | "--help" => usage("the bounded soak"),
            other => usage(&format!("unknown argument {other:?}")),
        }
    }
    let report = soak::run(&opts);
    print!("{}", soak::report_table(&report));
    let text =
        serde_json::to_string_pretty(&report).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    match &json_path {
        Some(p) => {
            if let Err(e) = std::fs::write(p, &text) {
                eprintln!("kvpn-soak: cannot write the JSON report to {p}: {e}");
                std::process::exit(1);
            }
            println!("JSON report: {p}");
        }
        None => println!("{text}"),
    }
    if report["ok"] != true {
        std::process::exit(1);
    }
}
