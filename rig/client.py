#!/usr/bin/python3
"""Headless SPICE client: real spice-gtk (libspice-client-glib 0.42) via GObject
introspection, no window, no GTK.  Debian packages: python3-gi,
gir1.2-spiceclientglib-2.0.  Run with /usr/bin/python3 (a pyenv/venv python
has no `gi`).

spice-gtk does the whole protocol itself: link/auth, every channel the server
offers (main, display, inputs, cursor; audio/usbredir/smartcard are switched
off here), SET_ACK -> ACK_SYNC, one ACK every `window` messages, PING -> PONG,
and it decodes every display message into its own primary surface.  This
script only counts what the display channel reports and can stall the GLib
main loop so that the client stops reading its sockets (backpressure).

  rig/client.py spice://127.0.0.1:5905 --seconds 30
  rig/client.py spice://127.0.0.1:5905 --seconds 60 --stall-ms 90 --period-ms 100
  rig/client.py spice://127.0.0.1:5905 --seconds 60 --pause-at 10 --pause-for 20
  rig/client.py spice://127.0.0.1:5905 --inputs-every-ms 50
                     # every channel talks: mouse motion (inputs; the cursor moves),
                     # a Shift press every 10th tick (inputs), a mouse-mode request
                     # every 10th tick (main)
  rig/client.py 'spice://127.0.0.1?tls-port=5905' --ca-file /tmp/t1/x509/ca-cert.pem
                     # TLS (rig/tls-certs.sh, rig/start-xspice.sh --tls): every channel over TLS,
                     # the server certificate checked against the CA and the host name
  rig/client.py spice://127.0.0.1:5905 --tls-port 5905 --ca-file ca-cert.pem --cert-subject CN=localhost
                     # (--tls-port alone: the URI's port is replaced by the TLS port)
  kill -USR1 <pid>   # stop reading (main loop blocked) until ...
  kill -USR2 <pid>   # ... resume
  ip netns exec rigc /path/to/rig/client.py spice://198.18.0.1:6905 --seconds 10
                     # inside rig/shape.sh's client namespace, through the relay

Options: URI [--seconds N=30] [--report S=5] [--pause-at T=10 --pause-for D=0]
         [--stall-ms S=0 --period-ms P=100] [--compression N]
         [--inputs-every-ms N=0]
         [--tls-port N] [--ca-file FILE] [--cert-subject S] [--verify hostname|subject|pubkey]
TLS: with a tls-port (in the URI, `spice://HOST?tls-port=N`, or --tls-port, which
drops the URI's plain port) and no plain port, spice-gtk opens every channel with
TLS (OpenSSL).  --ca-file is SpiceSession `ca-file` (PEM); the default check is the
host name against the server certificate's subjectAltName (`verify` HOSTNAME);
--cert-subject sets `cert-subject` and switches `verify` to SUBJECT (spice-gtk's
format: "CN=localhost", comma-separated RDNs).  A failed check is the channel event
'error-tls' (the session ends, exit 1).  The SUMMARY says `tls: true|false`.
It is a foreground program: the caller owns its PID (no pid file, no state
dir); SIGTERM/SIGINT end it early and still print the SUMMARY.

Throttling: every --period-ms the main loop is blocked for --stall-ms (so the
client reads for only (period-stall)/period of the time), and/or blocked once
from --pause-at for --pause-for seconds, and/or while SIGUSR1 is in force.
While blocked, nothing is read from any channel socket: the client's receive
queue fills, then the server's send queue, then spice-server stops sending
(its ACK window is also exhausted because no ACK goes out).

Prints one line of stats per --report seconds and a JSON summary at the end
(on stdout, prefixed with 'SUMMARY ').  Each channel's local TCP port is
printed when it opens, to match it with tshark / ss / eBPF output.
Exit status: 0 if the session stayed up for --seconds, 1 otherwise.
"""
import argparse
import json
import signal
import sys
import time

import gi
gi.require_version('SpiceClientGLib', '2.0')
from gi.repository import GLib, GObject, SpiceClientGLib as Spice  # noqa: E402

# SpiceSession.connect()/SpiceChannel.connect() shadow GObject's signal
# connect(), so signals are always wired with GObject.Object.connect().
on = GObject.Object.connect

EV = {int(v): v.value_nick for v in Spice.ChannelEvent.__enum_values__.values()}


class Client:
    def __init__(self, a):
        self.a = a
        self.loop = GLib.MainLoop()
        self.t0 = time.monotonic()
        self.chans = {}           # key -> dict(stats)
        self.ok = True
        self.paused = False       # toggled by SIGUSR1/SIGUSR2
        self.quitting = False     # SIGTERM: end any stall at once
        self.stalled_s = 0.0
        self.ticks = 0
        s = self.session = Spice.Session()
        s.props.uri = a.uri
        if a.tls_port:
            s.props.port = None          # TLS only: no plain port to fall back to
            s.props.tls_port = str(a.tls_port)
        if a.ca_file:
            s.props.ca_file = a.ca_file
        if a.cert_subject:
            s.props.cert_subject = a.cert_subject
            if not a.verify:
                a.verify = 'subject'
        if a.verify:
            s.props.verify = {'hostname': Spice.SessionVerify.HOSTNAME,
                              'subject': Spice.SessionVerify.SUBJECT,
                              'pubkey': Spice.SessionVerify.PUBKEY}[a.verify]
        self.tls = bool(s.props.tls_port) and not s.props.port
        # keep the session to the channels an observer cares about
        s.props.enable_audio = False
        s.props.enable_usbredir = False
        s.props.enable_smartcard = False
        if a.compression:
            s.props.preferred_compression = a.compression
        on(s, 'channel-new', self.on_channel_new)
        on(s, 'disconnected', self.on_disconnected)

    # --- spice-gtk callbacks -------------------------------------------------
    def key(self, ch):
        return '%s-%d' % (Spice.Channel.type_to_string(ch.props.channel_type),
                          ch.props.channel_id)

    def on_channel_new(self, session, ch):
        k = self.key(ch)
        st = self.chans.setdefault(k, dict(invalidate=0, pixels=0, events=[],
                                           local_port=None, ch=ch, last_bytes=0))
        on(ch, 'channel-event', self.on_channel_event)
        if isinstance(ch, Spice.DisplayChannel):
            on(ch, 'display-invalidate', self.on_invalidate, st)
            on(ch, 'display-primary-create', self.on_primary, k)
            on(ch, 'display-mark', lambda c, m: None)
        # The application, not spice-gtk, opens every channel but main (spicy
        # and virt-viewer do the same in their channel-new handlers).  Without
        # this only the main channel is ever connected.
        if not isinstance(ch, Spice.MainChannel):
            ch.connect()   # spice_channel_connect(); GObject signals use on()

    def on_channel_event(self, ch, event):
        k = self.key(ch)
        st = self.chans[k]
        nick = EV.get(int(event), str(event))
        st['events'].append((round(time.monotonic() - self.t0, 3), nick))
        if nick == 'opened':
            st['opened'] = True
            sock = ch.props.socket
            if sock is not None:
                la, ra = sock.get_local_address(), sock.get_remote_address()
                st['local_port'] = la.get_port()
                print('channel %s opened local %s:%d -> %s:%d' % (
                    k, la.get_address().to_string(), la.get_port(),
                    ra.get_address().to_string(), ra.get_port()), flush=True)
        else:
            print('channel %s event %s' % (k, nick), flush=True)
            if k.startswith('main') and nick in ('closed', 'error-io', 'error-link',
                                                 'error-connect', 'error-auth',
                                                 'error-tls'):
                self.ok = False
                self.loop.quit()

    def on_invalidate(self, ch, x, y, w, h, st):
        st['invalidate'] += 1
        st['pixels'] += w * h

    def on_primary(self, ch, fmt, w, h, stride, shmid, imgdata, k):
        print('display %s primary surface %dx%d' % (k, w, h), flush=True)

    def on_disconnected(self, session):
        print('session disconnected', flush=True)
        self.ok = False
        self.loop.quit()

    # --- throttling ------------------------------------------------------------
    def block(self, seconds):
        """Block the main loop: no socket of any channel is read meanwhile."""
        t = time.monotonic()
        end = t + seconds
        while not self.quitting and time.monotonic() < end:
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        self.stalled_s += time.monotonic() - t

    def periodic_stall(self):
        self.block(self.a.stall_ms / 1000.0)
        return True

    def one_pause(self):
        print('pause: main loop blocked for %.1fs' % self.a.pause_for, flush=True)
        self.block(self.a.pause_for)
        print('pause: resumed', flush=True)
        return False

    def check_sigpause(self):
        if self.paused:
            print('SIGUSR1: main loop blocked', flush=True)
            t = time.monotonic()
            while (self.paused and not self.quitting
                   and time.monotonic() - self.t0 < self.a.seconds):
                time.sleep(0.05)
            self.stalled_s += time.monotonic() - t
            print('SIGUSR2: resumed', flush=True)
        return True

    # --- input chatter ---------------------------------------------------------
    def chatter(self):
        """Input traffic on channels that are otherwise quiet mid-session: a relative
        mouse motion (SPICE_MSGC_INPUTS_MOUSE_MOTION in server mouse mode; spice-server
        answers MOUSE_MOTION_ACK every 4, and the X pointer moves, so the cursor channel
        sends CURSOR_MOVE), every 10th tick a Shift_L press and release (KEY_DOWN/KEY_UP)
        and a server-mouse-mode request on main (MOUSE_MODE_REQUEST)."""
        self.ticks += 1
        for st in self.chans.values():
            ch = st['ch']
            if not st.get('opened'):
                continue
            if isinstance(ch, Spice.InputsChannel):
                d = 8 if self.ticks % 2 else -8
                ch.motion(d, d, 0)
                if self.ticks % 10 == 0:
                    ch.key_press_and_release(0x2a)
            elif isinstance(ch, Spice.MainChannel) and self.ticks % 10 == 0:
                ch.request_mouse_mode(1)   # SPICE_MOUSE_MODE_SERVER
        return True

    # --- reporting -------------------------------------------------------------
    def report(self):
        now = time.monotonic() - self.t0
        parts = []
        for k, st in sorted(self.chans.items()):
            b = st['ch'].props.total_read_bytes
            parts.append('%s %.0fkB/s' % (k, (b - st['last_bytes']) / 1024.0 / self.a.report))
            st['last_bytes'] = b
        disp = sum(st['invalidate'] for k, st in self.chans.items() if k.startswith('display'))
        print('t=%.0fs invalidates=%d stalled=%.1fs | %s' % (now, disp, self.stalled_s,
                                                            ', '.join(parts)), flush=True)
        return True

    def terminate(self):
        self.quitting = True
        self.paused = False
        self.loop.quit()

    def finish(self):
        self.loop.quit()
        return False

    def run(self):
        a = self.a
        signal.signal(signal.SIGUSR1, lambda *_: setattr(self, 'paused', True))
        signal.signal(signal.SIGUSR2, lambda *_: setattr(self, 'paused', False))
        signal.signal(signal.SIGTERM, lambda *_: self.terminate())
        GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGINT, self.finish)
        if not self.session.connect():
            print('spice_session_connect failed', file=sys.stderr)
            return 1
        if a.stall_ms > 0:
            GLib.timeout_add(a.period_ms, self.periodic_stall)
        if a.pause_for > 0:
            GLib.timeout_add(int(a.pause_at * 1000), self.one_pause)
        GLib.timeout_add(50, self.check_sigpause)
        if a.inputs_every_ms > 0:
            GLib.timeout_add(a.inputs_every_ms, self.chatter)
        GLib.timeout_add(int(a.report * 1000), self.report)
        GLib.timeout_add(int(a.seconds * 1000), self.finish)
        self.loop.run()
        el = time.monotonic() - self.t0
        summary = dict(uri=a.uri, tls=self.tls, seconds=round(el, 2), ok=self.ok,
                       stalled_s=round(self.stalled_s, 2), channels={})
        for k, st in sorted(self.chans.items()):
            b = st['ch'].props.total_read_bytes
            summary['channels'][k] = dict(read_bytes=b, mbit_s=round(b * 8 / el / 1e6, 3),
                                          invalidate=st['invalidate'],
                                          invalidate_per_s=round(st['invalidate'] / el, 1),
                                          local_port=st['local_port'], events=st['events'])
        self.session.disconnect()
        print('SUMMARY ' + json.dumps(summary), flush=True)
        return 0 if self.ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('uri', help='spice://HOST:PORT')
    ap.add_argument('--seconds', type=float, default=30)
    ap.add_argument('--report', type=float, default=5, help='stats line every N s')
    ap.add_argument('--stall-ms', type=int, default=0, help='block main loop this long ...')
    ap.add_argument('--period-ms', type=int, default=100, help='... every this many ms')
    ap.add_argument('--pause-at', type=float, default=10)
    ap.add_argument('--pause-for', type=float, default=0, help='one long stall (s)')
    ap.add_argument('--inputs-every-ms', type=int, default=0,
                    help='mouse motion every N ms, key and mouse-mode request every 10th')
    ap.add_argument('--compression', type=int, default=0,
                    help='SpiceImageCompression to ask for (0 = server default)')
    ap.add_argument('--tls-port', type=int, default=0,
                    help='connect every channel with TLS to this port (no plain port)')
    ap.add_argument('--ca-file', help='CA certificate (PEM) to verify the server with')
    ap.add_argument('--cert-subject', help='expected server certificate subject, e.g. CN=localhost')
    ap.add_argument('--verify', choices=('hostname', 'subject', 'pubkey'),
                    help='what to check of the server certificate (default hostname)')
    a = ap.parse_args()
    sys.exit(Client(a).run())


if __name__ == '__main__':
    main()
