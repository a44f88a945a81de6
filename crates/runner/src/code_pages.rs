//! Lets go of the binary's code pages once the first batch is done.
//!
//! Planning a SQL query runs code from all over DataFusion's 100 MB of machine
//! code: its function registry, parser, optimizer and physical planner, a few
//! hundred places once each. The kernel maps a page cache folio around every
//! page it faults in (64 KiB or more), so those few hundred calls left about
//! 45 MiB of code mapped into the process for the rest of its life, more than
//! the batch loop ever runs (a query without SQL maps 9 MiB in all). Unmapped,
//! the pages stay in the page cache, where the kernel can reclaim them; the
//! code the batch loop runs is mapped again at its next call, from the cache.

/// Unmaps the binary's executable pages. Nothing else is touched: a read-only,
/// never-written mapping refills from its file, so only the mapping goes.
#[cfg(target_os = "linux")]
pub fn release_startup_code() {
    let Ok(exe) = std::fs::read_link("/proc/self/exe") else {
        return;
    };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return;
    };
    let mut released = 0usize;
    for (start, end) in executable_ranges(&maps, &exe.to_string_lossy()) {
        // SAFETY: the range is one of this process's executable file
        // mappings as the kernel listed it, page-aligned. Its pages are
        // private, read-only and never written (no copy-on-write page holds
        // anything the file does not), so MADV_DONTNEED only drops them from
        // the page tables, and the next call into them maps them again from
        // the file's pages in the page cache.
        let done =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        if done == 0 {
            released += end - start;
        }
    }
    tracing::debug!(
        mapped_bytes = released,
        "let go of the code pages starting used"
    );
}

/// Without Linux's `/proc`, nothing to do.
#[cfg(not(target_os = "linux"))]
pub fn release_startup_code() {}

/// The address ranges of `maps` (as `/proc/self/maps` gives them) that map
/// `path` readable and executable, privately, and not writable.
fn executable_ranges(maps: &str, path: &str) -> Vec<(usize, usize)> {
    maps.lines()
        .filter_map(|line| {
            // Five fields, then the path, which may hold spaces.
            let mut rest = line;
            let mut fields = [""; 5];
            for field in &mut fields {
                rest = rest.trim_start();
                let end = rest.find(' ').unwrap_or(rest.len());
                *field = &rest[..end];
                rest = &rest[end..];
            }
            let [range, perms, ..] = fields;
            if perms != "r-xp" || rest.trim() != path {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            let start = usize::from_str_radix(start, 16).ok()?;
            let end = usize::from_str_radix(end, 16).ok()?;
            (end > start).then_some((start, end))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::executable_ranges;

    #[test]
    fn only_the_binarys_executable_private_mappings_are_taken() {
        let maps = "\
55a0c0000000-55a0c1000000 r--p 00000000 fe:00 7635054                    /opt/sluice
55a0c1000000-55a0c7000000 r-xp 01000000 fe:00 7635054                    /opt/sluice
55a0c7000000-55a0c7400000 r--p 07000000 fe:00 7635054                    /opt/sluice
55a0c7400000-55a0c7500000 rw-p 07400000 fe:00 7635054                    /opt/sluice
7f00d9564000-7f00d96ba000 r-xp 00026000 fe:00 326269                     /usr/lib/x86_64-linux-gnu/libc.so.6
7f00d9600000-7f00d9700000 rwxp 00000000 00:00 0
7fffb23b9000-7fffb23da000 rw-p 00000000 00:00 0                          [stack]
7f10c1000000-7f10c2000000 r-xp 00010000 fe:00 1234                       /opt/my builds/sluice
";
        assert_eq!(
            executable_ranges(maps, "/opt/sluice"),
            [(0x55a0_c100_0000, 0x55a0_c700_0000)]
        );
        assert!(executable_ranges(maps, "/opt/other").is_empty());
        assert_eq!(
            executable_ranges(maps, "/opt/my builds/sluice"),
            [(0x7f10_c100_0000, 0x7f10_c200_0000)]
        );
    }

    /// This test binary's own code is found and let go of, and it runs on.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_running_binarys_code_is_found_and_runs_on_after_it_is_let_go() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(!executable_ranges(&maps, &exe.to_string_lossy()).is_empty());
        super::release_startup_code();
        assert_eq!(format!("{}", 40 + 2), "42");
    }
}
