//! Which distribution release this is (from `/etc/os-release`), and whether
//! an `apt-get install` plan takes only new packages from that release's own
//! archive. Pure functions over text: the unit tests feed them the files and
//! the apt output of Debian 11–13 and Ubuntu 20.04–24.04.

/// The fields of `/etc/os-release` that name a release.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OsRelease {
    pub id: String,
    pub version_id: String,
    pub id_like: Vec<String>,
    pub codename: String,
    pub pretty_name: String,
}

/// Parses os-release(5): `KEY=value` lines, values optionally quoted.
pub fn parse_os_release(text: &str) -> OsRelease {
    let mut os = OsRelease::default();
    for line in text.lines() {
        let Some((key, value)) = line.trim().split_once('=') else { continue };
        let value = value.trim().trim_matches(|c| c == '"' || c == '\'').to_owned();
        match key {
            "ID" => os.id = value,
            "VERSION_ID" => os.version_id = value,
            "ID_LIKE" => os.id_like = value.split_whitespace().map(str::to_owned).collect(),
            "VERSION_CODENAME" => os.codename = value,
            "PRETTY_NAME" => os.pretty_name = value,
            _ => {}
        }
    }
    os
}

/// A release this project knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// `Debian` or `Ubuntu`: the origin apt prints for its own archive.
    pub origin: &'static str,
    /// `12`, `22.04`: the release's version as apt's origin lines carry it.
    pub version: &'static str,
    pub codename: &'static str,
    /// Whether `cargo xtask` builds here (11 and 20.04 only run the dist binary).
    pub builds: bool,
}

impl Release {
    pub fn name(&self) -> String {
        format!("{} {} ({})", self.origin, self.version, self.codename)
    }
}

const KNOWN: [Release; 6] = [
    Release { origin: "Debian", version: "11", codename: "bullseye", builds: false },
    Release { origin: "Debian", version: "12", codename: "bookworm", builds: true },
    Release { origin: "Debian", version: "13", codename: "trixie", builds: true },
    Release { origin: "Ubuntu", version: "20.04", codename: "focal", builds: false },
    Release { origin: "Ubuntu", version: "22.04", codename: "jammy", builds: true },
    Release { origin: "Ubuntu", version: "24.04", codename: "noble", builds: true },
];

/// The known release `os` is, by ID and VERSION_ID (a derivative, such as
/// Mint with `ID_LIKE=ubuntu`, is not one: its archive is not Ubuntu's).
pub fn known_release(os: &OsRelease) -> Option<Release> {
    let origin = match os.id.as_str() {
        "debian" => "Debian",
        "ubuntu" => "Ubuntu",
        _ => return None,
    };
    KNOWN.iter().copied().find(|r| r.origin == origin && r.version == os.version_id)
}

/// What to install by hand where the release is not known: the one line said before stopping.
pub fn unknown_release_advice(os: &OsRelease) -> String {
    let name = if os.pretty_name.is_empty() { format!("{} {}", os.id, os.version_id) } else { os.pretty_name.clone() };
    let like = if os.id_like.is_empty() { String::new() } else { format!(" (like {})", os.id_like.join(", ")) };
    format!(
        "{name}{like} is not a release this setup knows (Debian 12/13, Ubuntu 22.04/24.04): install gcc from its own \
         package manager, and rustup's nightly with rust-src (`rustup toolchain install nightly --component rust-src`), \
         then run this again"
    )
}

/// One package in an `apt-get install -s` plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub package: String,
    /// The installed version it would replace (an upgrade or downgrade).
    pub replaces: Option<String>,
    pub version: String,
    /// `Debian:12.12/stable`, `Debian-Security:12/stable-security`, `Ubuntu:22.04/jammy-updates`.
    pub origins: Vec<String>,
}

/// What `apt-get install -s` would do: the `Inst` lines, and the packages of
/// its `Remv` lines.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub installs: Vec<Planned>,
    pub removals: Vec<String>,
}

/// Parses apt's simulation: `Inst gcc-12 (12.2.0-14 Debian:12.12/stable [amd64])`,
/// `Inst libc6 [2.36-9] (2.41-12 Debian:13.1/stable [amd64]) []`, `Remv foo [1.0]`.
pub fn parse_apt_simulation(text: &str) -> Plan {
    let mut plan = Plan::default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Remv ") {
            if let Some(package) = rest.split_whitespace().next() {
                plan.removals.push(package.to_owned());
            }
            continue;
        }
        let Some(rest) = line.strip_prefix("Inst ") else { continue };
        let mut words = rest.splitn(2, ' ');
        let package = words.next().unwrap_or_default().to_owned();
        let rest = words.next().unwrap_or_default().trim_start();
        let (replaces, rest) = match rest.strip_prefix('[').and_then(|r| r.split_once(']')) {
            Some((old, rest)) => (Some(old.to_owned()), rest.trim_start()),
            None => (None, rest),
        };
        let inner = rest.strip_prefix('(').and_then(|r| r.split_once(')')).map_or("", |(inner, _)| inner);
        // `VERSION ORIGIN[, ORIGIN…] [ARCH]`
        let inner = inner.rsplit_once(" [").map_or(inner, |(before, _)| before);
        let (version, origins) = inner.split_once(' ').unwrap_or((inner, ""));
        plan.installs.push(Planned {
            package,
            replaces,
            version: version.to_owned(),
            origins: origins.split(", ").map(str::trim).filter(|o| !o.is_empty()).map(str::to_owned).collect(),
        });
    }
    plan
}

/// Whether an apt origin (`Debian-Security:12/stable-security`) is `release`'s
/// own archive: its origin (`Debian`, `Debian-Security`, `Ubuntu`) and a version of
/// that release (`12`, `12.12`, `22.04`).
pub fn origin_is_release(origin: &str, release: &Release) -> bool {
    let Some((label, rest)) = origin.split_once(':') else { return false };
    let version = rest.split('/').next().unwrap_or_default();
    let label_ok = label == release.origin || label == format!("{}-Security", release.origin);
    let version_ok =
        version == release.version || version.strip_prefix(release.version).is_some_and(|r| r.starts_with('.'));
    label_ok && version_ok
}

/// Why `plan` is not one a setup may carry out on `release`, or the new
/// packages it adds (what setup names before it installs).
pub fn check_plan(plan: &Plan, release: &Release) -> Result<Vec<String>, String> {
    if !plan.removals.is_empty() {
        return Err(format!("apt would remove {}", plan.removals.join(", ")));
    }
    let changed: Vec<String> = plan
        .installs
        .iter()
        .filter_map(|p| p.replaces.as_ref().map(|old| format!("{} {old} → {}", p.package, p.version)))
        .collect();
    if !changed.is_empty() {
        return Err(format!("apt would change installed packages: {}", changed.join(", ")));
    }
    let foreign: Vec<String> = plan
        .installs
        .iter()
        .filter(|p| !p.origins.iter().any(|o| origin_is_release(o, release)))
        .map(|p| format!("{} {} from {}", p.package, p.version, p.origins.join(", ")))
        .collect();
    if !foreign.is_empty() {
        return Err(format!(
            "apt would take packages from outside {}'s archive: {}",
            release.name(),
            foreign.join("; ")
        ));
    }
    Ok(plan.installs.iter().map(|p| p.package.clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEBIAN_11: &str = "PRETTY_NAME=\"Debian GNU/Linux 11 (bullseye)\"\nNAME=\"Debian GNU/Linux\"\n\
        VERSION_ID=\"11\"\nVERSION=\"11 (bullseye)\"\nVERSION_CODENAME=bullseye\nID=debian\n";
    const DEBIAN_12: &str = "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nNAME=\"Debian GNU/Linux\"\n\
        VERSION_ID=\"12\"\nVERSION=\"12 (bookworm)\"\nVERSION_CODENAME=bookworm\nID=debian\n\
        HOME_URL=\"https://www.debian.org/\"\n";
    const DEBIAN_13: &str = "PRETTY_NAME=\"Debian GNU/Linux 13 (trixie)\"\nNAME=\"Debian GNU/Linux\"\n\
        VERSION_ID=\"13\"\nVERSION=\"13 (trixie)\"\nVERSION_CODENAME=trixie\nDEBIAN_VERSION_FULL=13.1\nID=debian\n";
    const UBUNTU_2204: &str = "PRETTY_NAME=\"Ubuntu 22.04.5 LTS\"\nNAME=\"Ubuntu\"\nVERSION_ID=\"22.04\"\n\
        VERSION=\"22.04.5 LTS (Jammy Jellyfish)\"\nVERSION_CODENAME=jammy\nID=ubuntu\nID_LIKE=debian\n\
        UBUNTU_CODENAME=jammy\n";
    const UBUNTU_2404: &str = "PRETTY_NAME=\"Ubuntu 24.04.3 LTS\"\nNAME=\"Ubuntu\"\nVERSION_ID=\"24.04\"\n\
        VERSION=\"24.04.3 LTS (Noble Numbat)\"\nVERSION_CODENAME=noble\nID=ubuntu\nID_LIKE=debian\n";
    const MINT: &str = "NAME=\"Linux Mint\"\nVERSION=\"21.3 (Virginia)\"\nID=linuxmint\nID_LIKE=\"ubuntu debian\"\n\
        PRETTY_NAME=\"Linux Mint 21.3\"\nVERSION_ID=\"21.3\"\nVERSION_CODENAME=virginia\n";
    const FEDORA: &str = "NAME=\"Fedora Linux\"\nVERSION=\"41 (Server Edition)\"\nID=fedora\nVERSION_ID=41\n\
        PRETTY_NAME=\"Fedora Linux 41 (Server Edition)\"\n";
    const DEBIAN_SID: &str = "PRETTY_NAME=\"Debian GNU/Linux forky/sid\"\nNAME=\"Debian GNU/Linux\"\nID=debian\n";

    fn release(text: &str) -> Option<Release> {
        known_release(&parse_os_release(text))
    }

    #[test]
    fn known_releases_by_id_and_version() {
        assert_eq!(release(DEBIAN_12).map(|r| r.codename), Some("bookworm"));
        assert_eq!(release(DEBIAN_13).map(|r| r.codename), Some("trixie"));
        assert_eq!(release(UBUNTU_2204).map(|r| r.codename), Some("jammy"));
        assert_eq!(release(UBUNTU_2404).map(|r| r.codename), Some("noble"));
        assert!(release(DEBIAN_12).is_some_and(|r| r.builds && r.origin == "Debian" && r.version == "12"));
        assert!(release(UBUNTU_2404).is_some_and(|r| r.builds && r.origin == "Ubuntu"));
        // Known, for running the dist binary, not for building.
        assert!(release(DEBIAN_11).is_some_and(|r| !r.builds));
    }

    #[test]
    fn derivatives_and_others_are_unknown_and_get_advice() {
        for text in [MINT, FEDORA, DEBIAN_SID] {
            let os = parse_os_release(text);
            assert_eq!(known_release(&os), None, "{text}");
            let advice = unknown_release_advice(&os);
            assert!(advice.contains("gcc") && advice.contains("rust-src"), "{advice}");
        }
        let mint = parse_os_release(MINT);
        assert_eq!(mint.id_like, ["ubuntu", "debian"]);
        assert!(unknown_release_advice(&mint).starts_with("Linux Mint 21.3 (like ubuntu, debian) is not"));
    }

    #[test]
    fn os_release_quoting() {
        let os = parse_os_release("ID='ubuntu'\nVERSION_ID=24.04\n# a comment\n\nVERSION_CODENAME=\"noble\"\n");
        assert_eq!((os.id.as_str(), os.version_id.as_str(), os.codename.as_str()), ("ubuntu", "24.04", "noble"));
    }

    const BOOKWORM: Release = KNOWN[1];
    const JAMMY: Release = KNOWN[4];

    /// `apt-get install -s --no-install-recommends gcc libc6-dev` in a Debian 12 minbase root.
    const GCC_ON_BOOKWORM: &str = "NOTE: This is only a simulation!\n\
        Reading package lists...\n\
        Inst binutils-common (2.40-2 Debian:12.12/stable [amd64])\n\
        Inst libgcc-12-dev (12.2.0-14+deb12u1 Debian:12.12/stable [amd64])\n\
        Inst linux-libc-dev (6.1.158-1 Debian-Security:12/stable-security, Debian:12.12/stable [amd64])\n\
        Inst gcc (4:12.2.0-3 Debian:12.12/stable [amd64])\n\
        Conf gcc (4:12.2.0-3 Debian:12.12/stable [amd64])\n";

    #[test]
    fn a_plan_of_new_packages_from_the_hosts_release_is_named() {
        let plan = parse_apt_simulation(GCC_ON_BOOKWORM);
        assert_eq!(plan.installs.len(), 4);
        assert_eq!(plan.installs[2].origins, ["Debian-Security:12/stable-security", "Debian:12.12/stable"]);
        assert_eq!(plan.installs[3].version, "4:12.2.0-3");
        assert_eq!(
            check_plan(&plan, &BOOKWORM),
            Ok(vec!["binutils-common".into(), "libgcc-12-dev".into(), "linux-libc-dev".into(), "gcc".into()])
        );
    }

    #[test]
    fn a_plan_that_upgrades_or_removes_or_takes_another_release_is_refused() {
        // What `-t trixie llvm-22-dev` did to a Debian 12 host.
        let trixie = "Inst libc6 [2.36-9+deb12u10] (2.41-12 Debian:13.1/stable [amd64]) []\n\
                      Inst llvm-22-dev (1:22.1.8-1 Debian:13.1/stable [amd64])\n";
        let err = check_plan(&parse_apt_simulation(trixie), &BOOKWORM).expect_err("refused");
        assert!(err.contains("libc6 2.36-9+deb12u10 → 2.41-12"), "{err}");
        // New packages, but from Debian 13's archive.
        let foreign = "Inst llvm-22-dev (1:22.1.8-1 Debian:13.1/stable [amd64])\n";
        let err = check_plan(&parse_apt_simulation(foreign), &BOOKWORM).expect_err("refused");
        assert!(err.contains("outside Debian 12 (bookworm)'s archive") && err.contains("llvm-22-dev"), "{err}");
        // 12 is not a prefix of 120, nor is Debian Ubuntu.
        assert!(!origin_is_release("Debian:120/stable", &BOOKWORM));
        assert!(!origin_is_release("Ubuntu:22.04/jammy", &BOOKWORM));
        let removal = "Remv gcc-12 [12.2.0-14]\nInst gcc (4:12.2.0-3 Debian:12.12/stable [amd64])\n";
        assert_eq!(check_plan(&parse_apt_simulation(removal), &BOOKWORM), Err("apt would remove gcc-12".into()));
    }

    #[test]
    fn ubuntu_origins_are_its_pockets() {
        let plan = parse_apt_simulation(
            "Inst gcc-11 (11.4.0-1ubuntu1~22.04.2 Ubuntu:22.04/jammy-updates, Ubuntu:22.04/jammy-security [amd64])\n\
             Inst gcc (4:11.2.0-1ubuntu1 Ubuntu:22.04/jammy [amd64])\n",
        );
        assert_eq!(check_plan(&plan, &JAMMY), Ok(vec!["gcc-11".into(), "gcc".into()]));
        assert!(check_plan(&plan, &BOOKWORM).is_err());
    }
}
