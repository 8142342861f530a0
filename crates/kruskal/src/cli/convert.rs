//! `kruskal convert`: between FROSTT text (.tns, .tns.gz) and kruskal's
//! binary format (.ktns), reporting read and write throughput.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use kruskal_formats::write_tensor;

use super::common::ReadArgs;
use kruskal::console::{spinner, thousands};
use kruskal::input::read_file;

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Input tensor (.tns, .tns.gz or .ktns).
    pub input: PathBuf,
    /// Output tensor; its extension picks the format (.tns, .tns.gz, .ktns).
    pub output: PathBuf,
    /// Accepted for old scripts: nonzeros that share a coordinate are now
    /// always summed when a tensor is read.
    #[arg(long, hide = true)]
    pub coalesce: bool,
    #[command(flatten)]
    pub read: ReadArgs,
}

fn size(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

pub fn run(args: ConvertArgs) -> Result<()> {
    if args.input == args.output {
        bail!(
            "input and output are the same file: {}",
            args.input.display()
        );
    }
    // The output's extension picks its format: refused before the input
    // is read, which may take minutes.
    kruskal_formats::io::FileKind::from_path(&args.output)?;
    let start = Instant::now();
    let (t, _) = read_file(&args.input, &args.read.options())?;
    let read_s = start.elapsed().as_secs_f64();
    let in_bytes = size(&args.input);
    println!(
        "read   {} ({:.1} MB) in {:.2} s: {:.0} MB/s, {:.1} M nonzeros/s",
        args.input.display(),
        in_bytes as f64 / 1e6,
        read_s,
        in_bytes as f64 / 1e6 / read_s,
        t.nnz() as f64 / 1e6 / read_s
    );
    let start = Instant::now();
    super::cleanup::track_output(&args.output);
    super::cleanup::quit_on_signal()?;
    let bar = spinner(&format!("writing {}", args.output.display()));
    let written = write_tensor(&args.output, &t);
    bar.finish_and_clear();
    written?;
    let write_s = start.elapsed().as_secs_f64();
    let out_bytes = size(&args.output);
    println!(
        "wrote  {} ({:.1} MB) in {:.2} s: {:.0} MB/s; {} modes, {} nonzeros",
        args.output.display(),
        out_bytes as f64 / 1e6,
        write_s,
        out_bytes as f64 / 1e6 / write_s,
        t.nmodes(),
        thousands(t.nnz() as u64)
    );
    Ok(())
}
