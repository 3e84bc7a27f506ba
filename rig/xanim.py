#!/usr/bin/python3
"""Continuously animating X11 client: the display-traffic generator for Xspice.

Uses Debian's python3-xlib (pure Python, no toolkit).  Run with the system
interpreter (/usr/bin/python3); a pyenv/venv python usually lacks Xlib.

Every frame it draws into one window that covers the screen:
  --mode noise   PutImage of os.urandom() pixels in a WxH box at a moving spot.
                 Incompressible, so spice-server sends big DRAW_COPY messages
                 (the heavy-traffic case; the easiest way to fill socket buffers).
  --mode rects   N solid FillRectangle()s of random colours.  Many small
                 DRAW_FILL messages (high message rate, little bandwidth).
  --mode bars    A moving gradient band (PutImage, compressible): medium traffic.

Usage:
  DISPLAY=:N rig/xanim.py [--mode noise|rects|bars] [--fps F] [--size WxH]
                          [--count N] [--seconds S | --frames N] [--seed N]
                          [--ready-file FILE] [--cursor-every N]
Examples:
  DISPLAY=:5 rig/xanim.py --mode noise --fps 20 --size 256x192
  DISPLAY=:5 rig/xanim.py --mode rects --fps 50 --count 20
  DISPLAY=:5 rig/xanim.py --mode noise --seconds 5   # then exit: the session goes idle
--cursor-every N: every N frames the root window's cursor changes (cycling through three
ARGB cursors of the Adwaita theme, loaded with libXcursor) and the pointer is warped to a
new spot: spice-server's cursor channel then carries CURSOR_SET / CURSOR_MOVE mid-session
(Xspice draws the X cursor font's two-colour cursors in software, on the display channel).
It never exits on its own unless --seconds or --frames is given; stop it with
SIGTERM.  It retries connecting to the X server for up to 10 s (so it can be
started right after Xorg), touches --ready-file after the first frame has
been drawn, and prints "xanim: N frames in T s" on stderr at exit.
rig/start-xspice.sh starts it; it needs no state of its own.
"""
import argparse
import os
import random
import signal
import sys
import time

from Xlib import X, display

MAX_REQ = 200 * 1024  # keep each PutImage below the core 256 KiB request limit


def put_image(win, gc, x, y, w, h, data):
    """PutImage split into horizontal strips that fit one X request."""
    stride = w * 4
    rows = max(1, MAX_REQ // stride)
    for r0 in range(0, h, rows):
        rh = min(rows, h - r0)
        win.put_image(gc, x, y + r0, w, rh, X.ZPixmap, 24, 0,
                      data[r0 * stride:(r0 + rh) * stride])


class ArgbCursors:
    """Root-window cursor changes and pointer warps through libX11 and libXcursor (ctypes;
    python3-xlib has no Render extension, which ARGB cursors need)."""

    THEME = '/usr/share/icons/Adwaita/cursors/'

    def __init__(self):
        import ctypes
        c = ctypes
        self.x11 = x11 = c.CDLL('libX11.so.6')
        xc = c.CDLL('libXcursor.so.1')
        x11.XOpenDisplay.restype = c.c_void_p
        x11.XDefaultRootWindow.restype = c.c_ulong
        x11.XDefaultRootWindow.argtypes = [c.c_void_p]
        xc.XcursorFilenameLoadCursor.restype = c.c_ulong
        xc.XcursorFilenameLoadCursor.argtypes = [c.c_void_p, c.c_char_p]
        x11.XDefineCursor.argtypes = [c.c_void_p, c.c_ulong, c.c_ulong]
        x11.XWarpPointer.argtypes = [c.c_void_p, c.c_ulong, c.c_ulong, c.c_int, c.c_int,
                                     c.c_uint, c.c_uint, c.c_int, c.c_int]
        x11.XFlush.argtypes = [c.c_void_p]
        self.d = x11.XOpenDisplay(None)
        if not self.d:
            raise RuntimeError('XOpenDisplay failed')
        self.root = x11.XDefaultRootWindow(self.d)
        self.cursors = [xc.XcursorFilenameLoadCursor(self.d, (self.THEME + n).encode())
                        for n in ('left_ptr', 'hand2', 'crosshair')]
        if not all(self.cursors):
            raise RuntimeError('cannot load the cursors of ' + self.THEME)

    def step(self, k, sw, sh):
        self.x11.XDefineCursor(self.d, self.root, self.cursors[k % len(self.cursors)])
        self.x11.XWarpPointer(self.d, 0, self.root, 0, 0, 0, 0, (k * 53) % sw, (k * 31) % sh)
        self.x11.XFlush(self.d)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mode', choices=['noise', 'rects', 'bars'], default='noise')
    ap.add_argument('--fps', type=float, default=20.0)
    ap.add_argument('--size', default='256x192', help='WxH of the noise/bars box')
    ap.add_argument('--count', type=int, default=20, help='rectangles per frame (rects)')
    ap.add_argument('--seconds', type=float, default=0, help='stop after this long (0=never)')
    ap.add_argument('--frames', type=int, default=0, help='stop after this many frames (0=never)')
    ap.add_argument('--ready-file', help='touch this file once the first frame is drawn')
    ap.add_argument('--seed', type=int, default=1)
    ap.add_argument('--cursor-every', type=int, default=0,
                    help='change the cursor and warp the pointer every N frames (0=never)')
    a = ap.parse_args()
    bw, bh = (int(v) for v in a.size.lower().split('x'))
    rnd = random.Random(a.seed)

    d = None
    deadline = time.monotonic() + 10
    while d is None:
        try:
            d = display.Display()
        except Exception as e:  # Xlib.error.DisplayConnectionError and socket errors
            if time.monotonic() > deadline:
                print('xanim: cannot connect to X: %s' % e, file=sys.stderr)
                sys.exit(1)
            time.sleep(0.05)
    scr = d.screen()
    sw, sh = scr.width_in_pixels, scr.height_in_pixels
    win = scr.root.create_window(0, 0, sw, sh, 0, scr.root_depth,
                                 background_pixel=scr.black_pixel,
                                 override_redirect=1)
    win.map()
    gc = win.create_gc(foreground=scr.white_pixel, background=scr.black_pixel)
    cursors = ArgbCursors() if a.cursor_every > 0 else None
    d.sync()

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))

    period = 1.0 / a.fps
    t0 = time.monotonic()
    nxt = t0
    frame = 0
    band = bytes()
    if a.mode == 'bars':
        # one precomputed gradient row, shifted per frame (compressible)
        row = b''.join(bytes((i % 256, (i * 3) % 256, (255 - i) % 256, 0)) for i in range(bw * 2))
    while not stop:
        if a.mode == 'noise':
            x = (frame * 37) % max(1, sw - bw)
            y = (frame * 23) % max(1, sh - bh)
            put_image(win, gc, x, y, bw, bh, os.urandom(bw * bh * 4))
        elif a.mode == 'rects':
            for _ in range(a.count):
                gc.change(foreground=rnd.randrange(0xFFFFFF))
                w, h = rnd.randrange(8, 120), rnd.randrange(8, 90)
                win.fill_rectangle(gc, rnd.randrange(sw - w), rnd.randrange(sh - h), w, h)
        else:
            off = (frame * 4) % bw
            band = row[off * 4:(off + bw) * 4] * bh
            put_image(win, gc, 0, (frame * 2) % max(1, sh - bh), bw, bh, band)
        if cursors and frame % a.cursor_every == 0:
            cursors.step(frame // a.cursor_every, sw, sh)
        d.sync()  # wait for the X server so the frame rate is real
        frame += 1
        if frame == 1:
            print('xanim: drawing %s on %dx%d' % (a.mode, sw, sh), file=sys.stderr, flush=True)
            if a.ready_file:
                open(a.ready_file, 'w').close()
        if a.seconds and time.monotonic() - t0 >= a.seconds:
            break
        if a.frames and frame >= a.frames:
            break
        nxt += period
        delay = nxt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            nxt = time.monotonic()
    el = time.monotonic() - t0
    print(f'xanim: {frame} frames in {el:.1f}s = {frame / el:.1f} fps', file=sys.stderr, flush=True)


if __name__ == '__main__':
    main()
