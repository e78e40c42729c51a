//! The other end's liveness (TRANSPORT.md §4): its control socket (HUP/ERR once it is
//! gone) and a pidfd of its process (readable once it exits; catches a dead peer whose
//! children still hold the socket). Checked with zero-timeout polls between wait slices.

use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::error::Error;

/// Longest single wait: between slices the caller checks signals, the peer and its
/// deadline.
pub const SLICE: Duration = Duration::from_millis(50);

/// The next wait slice before `deadline` (None: no limit), or None once it passed.
pub fn wait_slice(deadline: Option<Instant>) -> Option<Duration> {
    match deadline {
        Some(d) => {
            let now = Instant::now();
            if now >= d {
                None
            } else {
                Some((d - now).min(SLICE))
            }
        }
        None => Some(SLICE),
    }
}

/// The deadline `timeout_ms` from now (None: no limit).
pub fn deadline(timeout_ms: Option<u64>) -> Option<Instant> {
    timeout_ms.map(|t| Instant::now() + Duration::from_millis(t))
}

/// A close-on-exec duplicate of `fd`, which the caller owns and keeps open for the call.
pub fn dup_fd(fd: RawFd) -> Result<OwnedFd, Error> {
    let bad = |e: rustix::io::Errno| Error::Io {
        op: "duplicating",
        path: format!("fd {fd}"),
        source: e.into(),
    };
    if fd < 0 {
        return Err(bad(rustix::io::Errno::BADF));
    }
    // SAFETY: the caller passes an fd it owns and keeps open for this call; we only borrow it
    // to duplicate it (F_DUPFD_CLOEXEC), so ownership of the original stays with the caller.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    rustix::io::fcntl_dupfd_cloexec(borrowed, 3).map_err(bad)
}

/// The other end of a ring: watched through its control socket and its pid. Either may be
/// absent (then only the other is checked). Thread-compatible.
pub struct Peer {
    socket: Option<OwnedFd>,
    pidfd: Option<OwnedFd>,
    what: &'static str,
}

impl Peer {
    /// Watches nothing (until [`Peer::new`] replaces it).
    pub fn none(what: &'static str) -> Self {
        Peer {
            socket: None,
            pidfd: None,
            what,
        }
    }

    /// Watches `control_fd` (duplicated here) and process `pid` (a pidfd; a pid that does
    /// not exist, or a kernel without pidfd_open, leaves only the socket watched).
    pub fn new(
        control_fd: Option<RawFd>,
        pid: Option<i32>,
        what: &'static str,
    ) -> Result<Self, Error> {
        let socket = control_fd.map(dup_fd).transpose()?;
        let pidfd = pid.and_then(|p| {
            rustix::process::Pid::from_raw(p).and_then(|p| {
                rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
            })
        });
        Ok(Peer {
            socket,
            pidfd,
            what,
        })
    }

    /// Some(reason) if the peer is gone.
    pub fn dead(&self) -> Option<String> {
        use rustix::event::{poll, PollFd, PollFlags};
        if let Some(sock) = &self.socket {
            let mut fds = [PollFd::new(sock, PollFlags::RDHUP)];
            if poll(&mut fds, Some(&rustix::event::Timespec::default())).is_ok() {
                let r = fds[0].revents();
                if r.intersects(
                    PollFlags::HUP | PollFlags::ERR | PollFlags::RDHUP | PollFlags::NVAL,
                ) {
                    return Some(format!("the {} closed its control socket", self.what));
                }
            }
        }
        if let Some(pidfd) = &self.pidfd {
            let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
            if poll(&mut fds, Some(&rustix::event::Timespec::default())).is_ok()
                && fds[0].revents().contains(PollFlags::IN)
            {
                return Some(format!("the {} process exited", self.what));
            }
        }
        None
    }

    /// Err(PeerDied) if the peer is gone.
    pub fn check(&self) -> Result<(), Error> {
        match self.dead() {
            Some(what) => Err(Error::PeerDied { what }),
            None => Ok(()),
        }
    }
}

/// Err(RingState) unless this is process `pid` (a ring end cannot be used in a forked
/// child: its mapping is not inherited, MADV_DONTFORK, and its peer expects the parent).
pub fn check_pid(pid: u32, what: &str) -> Result<(), Error> {
    if std::process::id() != pid {
        return Err(Error::RingState(format!(
            "{what} cannot be used in a forked child; open a new connection"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn socketpair() -> (OwnedFd, OwnedFd) {
        rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    }

    #[test]
    fn a_closed_control_socket_is_a_dead_peer() {
        let (ours, theirs) = socketpair();
        let peer = Peer::new(Some(ours.as_raw_fd()), None, "producer").unwrap();
        drop(ours); // the peer keeps its own duplicate
        assert_eq!(peer.dead(), None);
        assert!(peer.check().is_ok());
        drop(theirs);
        let why = peer.dead().expect("HUP seen");
        assert!(why.contains("producer closed its control socket"), "{why}");
        assert!(matches!(peer.check(), Err(Error::PeerDied { .. })));
    }

    #[test]
    fn an_exited_process_is_a_dead_peer() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let peer = Peer::new(None, Some(child.id() as i32), "consumer").unwrap();
        assert_eq!(peer.dead(), None);
        child.kill().unwrap();
        child.wait().unwrap();
        let why = peer.dead().expect("pidfd readable");
        assert!(why.contains("consumer process exited"), "{why}");
    }

    #[test]
    fn nothing_watched_is_never_dead() {
        assert_eq!(Peer::none("consumer").dead(), None);
        // An fd that is not open is an error naming it, not a silently unwatched peer.
        assert!(Peer::new(Some(-1), None, "x").is_err(), "negative fd");
        let (a, b) = socketpair();
        let raw = a.as_raw_fd();
        drop((a, b));
        let e = Peer::new(Some(raw), None, "x").err().expect("closed fd");
        assert!(e.to_string().contains(&format!("fd {raw}")), "{e}");
    }

    #[test]
    fn slices_never_pass_the_deadline() {
        assert_eq!(wait_slice(None), Some(SLICE));
        let soon = Instant::now() + Duration::from_millis(5);
        assert!(wait_slice(Some(soon)).unwrap() <= Duration::from_millis(5));
        assert_eq!(
            wait_slice(Some(Instant::now() - Duration::from_millis(1))),
            None
        );
        assert!(deadline(None).is_none());
        assert!(check_pid(std::process::id(), "x").is_ok());
        assert!(check_pid(std::process::id() + 1, "x").is_err());
    }
}
