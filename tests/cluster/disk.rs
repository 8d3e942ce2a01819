//! A small ext4 filesystem in an image file, loop-mounted, for a node's data dir: a copy of
//! the image taken while the node runs is what its disk would hold had the machine lost
//! power then (the writes the filesystem still holds in memory are not in it), and its
//! writes can be throttled to make it a slow disk. Mounting and throttling need root, as
//! CI runs.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct LoopDisk {
    image: PathBuf,
    mount: PathBuf,
}

impl LoopDisk {
    /// Makes an ext4 image of `size_mib` MiB at `image` and mounts it at `mount`, which is
    /// made empty first.
    pub fn mount_new(image: &Path, mount: &Path, size_mib: u64) -> LoopDisk {
        let file = std::fs::File::create(image).unwrap();
        file.set_len(size_mib << 20).unwrap();
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(image));
        let _ = std::fs::remove_dir_all(mount);
        LoopDisk::mount(image, mount)
    }

    /// Mounts the ext4 image `image` at `mount` (created if missing).
    pub fn mount(image: &Path, mount: &Path) -> LoopDisk {
        std::fs::create_dir_all(mount).unwrap();
        // A journal commit every 600 s, not 5: the periodic one would put a file's creation
        // on the disk without a sync, at a moment the test cannot choose.
        run(Command::new("mount")
            .args(["-o", "loop,commit=600"])
            .arg(image)
            .arg(mount));
        let disk = LoopDisk {
            image: image.to_owned(),
            mount: mount.to_owned(),
        };
        // A run killed while it throttled this loop device (its guard never dropped) left
        // the limit on it: lifted, where the blkio controller exists.
        if let Some(throttle) = disk.throttle() {
            let _ = throttle.set(0);
        }
        disk
    }

    /// Copies the image to `to`: the disk as a power loss now would leave it.
    pub fn crash_image(&self, to: &Path) {
        std::fs::copy(&self.image, to).unwrap();
    }

    /// Shuts the filesystem down (`FS_IOC_SHUTDOWN` through `xfs_io`, which CI installs
    /// with `xfsprogs`), as a disk that fails does: from now on every write and sync on it
    /// fails with `EIO`. Unmounting and mounting the image again brings it back, its
    /// journal replayed.
    pub fn fail(&self) {
        run(Command::new("xfs_io")
            .args(["-x", "-c", "shutdown"])
            .arg(&self.mount));
    }

    /// Writes the filesystem's dirty pages back, as the kernel's flusher does on its own
    /// within half a minute.
    pub fn write_back(&self) {
        run(Command::new("sync").arg("-f").arg(&self.mount));
    }

    /// Holds the writes to the disk's loop device to `bytes_per_sec` until the returned
    /// guard drops, with the cgroup v1 blkio controller's throttle (the test and its nodes
    /// run in the root cgroup): a slow disk, where a sync of one block takes 4096 /
    /// `bytes_per_sec` seconds. Writes to the page cache do not wait.
    pub fn throttle_writes(&self, bytes_per_sec: u64) -> Throttle {
        let throttle = self.throttle().unwrap_or_else(|| {
            panic!(
                "{}: no loop device found mounted there",
                self.mount.display()
            )
        });
        throttle.set(bytes_per_sec).unwrap_or_else(|err| {
            panic!(
                "{}: {err} (the slow-disk test needs root and the cgroup v1 blkio controller)",
                Throttle::CONTROL
            )
        });
        throttle
    }

    /// The throttle of the disk's loop device, if it is found mounted.
    fn throttle(&self) -> Option<Throttle> {
        let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
        let device = mounts
            .lines()
            .filter_map(|line| {
                let mut fields = line.split(' ');
                Some((fields.next()?, fields.next()?))
            })
            .find(|(_, target)| Path::new(target) == self.mount)
            .map(|(source, _)| source)?;
        let name = Path::new(device).file_name()?.to_str()?;
        let numbers = std::fs::read_to_string(format!("/sys/class/block/{name}/dev")).ok()?;
        Some(Throttle {
            device: numbers.trim().to_owned(),
        })
    }
}

/// A loop device's writes held to a rate; lifted on drop.
pub struct Throttle {
    // The device's "major:minor".
    device: String,
}

impl Throttle {
    const CONTROL: &str = "/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device";

    fn set(&self, bytes_per_sec: u64) -> std::io::Result<()> {
        std::fs::write(
            Throttle::CONTROL,
            format!("{} {bytes_per_sec}", self.device),
        )
    }
}

impl Drop for Throttle {
    /// Lifts the limit (0 is none): the writes it held go at once.
    fn drop(&mut self) {
        let _ = self.set(0);
    }
}

impl Drop for LoopDisk {
    /// Unmounts lazily: a node still running on it lets go when it exits.
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

fn run(command: &mut Command) {
    let output = command
        .output()
        .unwrap_or_else(|err| panic!("{command:?}: {err} (the loop-disk tests need root)"));
    assert!(
        output.status.success(),
        "{command:?}: {}{} (the loop-disk tests need root and a loop device)",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
