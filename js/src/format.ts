/**
 * The texts this extension shows: byte counts, the status-bar item and its
 * tooltip, and what the sidebar says when the kernel it showed went away.
 * Pure functions (no DOM, no JupyterLab at run time): js/test/ tests them.
 */
import type { IDeviceStatus, IStatusPayload } from './protocol';

const KIB = 1024;
const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/** Digits of the exact decimal expansion: a double in [1, 1e21) has at most 52 after the point. */
const EXACT_DIGITS = 100;
/** From here on `toFixed` answers in exponent notation; such doubles are integers. */
const FIXED_LIMIT = 1e21;

/**
 * `value` (>= 0) with `digits` decimals, as Python's `f"{value:.{digits}f}"`
 * writes it: the exact value rounded, ties to even (`toFixed` takes ties up:
 * 1.25 -> "1.3" where Python writes "1.2").
 */
function toFixedLikePython(value: number, digits: number): string {
  if (value >= FIXED_LIMIT) {
    const whole = BigInt(value).toString();
    return digits > 0 ? `${whole}.${'0'.repeat(digits)}` : whole;
  }
  const rounded = value.toFixed(digits);
  const exact = value.toFixed(EXACT_DIGITS);
  const cut = exact.length - (EXACT_DIGITS - digits);
  const tie = /^50*$/.test(exact.slice(cut));
  const lastDigit = Number(rounded[rounded.length - 1]);
  if (!tie || lastDigit % 2 === 0) {
    return rounded;
  }
  return exact.slice(0, digits > 0 ? cut : cut - 1); // the even neighbour below
}

/**
 * A byte count in binary units, the same text as gpumem.core.units.format_bytes
 * (tests/fixtures/format_bytes.json holds cases both sides check): "1.5 KiB",
 * "512 B", "-64.0 MiB". A count the kernel did not know (null) reads "n/a",
 * as in the panel.
 */
export function formatBytes(
  bytes: number | null | undefined,
  precision = 1
): string {
  if (bytes === null || bytes === undefined || Number.isNaN(bytes)) {
    return 'n/a';
  }
  const sign = bytes < 0 ? '-' : '';
  let value = Math.abs(bytes);
  for (const unit of UNITS) {
    if (value < KIB || unit === UNITS[UNITS.length - 1]) {
      if (unit === 'B') {
        return `${sign}${Math.trunc(value)} B`;
      }
      const number = Number.isFinite(value)
        ? toFixedLikePython(value, precision)
        : 'inf';
      return `${sign}${number} ${unit}`;
    }
    value /= KIB;
  }
  throw new Error('unreachable');
}

/** Devices worth showing: those PyTorch holds memory on, else the first. */
export function shownDevices(payload: IStatusPayload): IDeviceStatus[] {
  const used = payload.devices.filter(
    d => (d.reserved_bytes ?? d.allocated_bytes) > 0
  );
  if (used.length) {
    return used;
  }
  return payload.devices.slice(0, 1);
}

/** "a / total", or "a" alone where a device's capacity is unknown. */
function usedOf(allocated: number, total: number | null | undefined): string {
  return total === null || total === undefined
    ? formatBytes(allocated)
    : `${formatBytes(allocated)} / ${formatBytes(total)}`;
}

/**
 * The status-bar text, e.g. "GPU 3.2 GiB / 140.0 GiB", "GPU ×2 1.0 GiB / 280.0 GiB"
 * or "RAM 1.3 GiB (no GPU in use)".
 */
export function statusText(payload: IStatusPayload): string {
  const devices = payload.cuda_in_use ? shownDevices(payload) : [];
  if (!devices.length) {
    return `RAM ${formatBytes(payload.host?.rss_bytes)} (no GPU in use)`;
  }
  if (devices.length === 1) {
    const d = devices[0];
    return `GPU ${usedOf(d.allocated_bytes, d.total_bytes)}`;
  }
  const allocated = devices.reduce((s, d) => s + d.allocated_bytes, 0);
  const totals = devices.map(d => d.total_bytes);
  const total = totals.every(t => typeof t === 'number')
    ? totals.reduce<number>((s, t) => s + (t ?? 0), 0)
    : null;
  return `GPU ×${devices.length} ${usedOf(allocated, total)}`;
}

/** A multi-line tooltip with every device and the host figure. */
export function statusTooltip(payload: IStatusPayload, where: string): string {
  const lines = [`GPU memory of ${where} (PyTorch allocator)`];
  if (!payload.cuda_in_use) {
    lines.push('No CUDA device in use in this kernel.');
  }
  for (const d of payload.cuda_in_use ? payload.devices : []) {
    const name = d.name ? ` ${d.name}` : '';
    lines.push(
      `cuda:${d.index}${name}: allocated ${formatBytes(d.allocated_bytes)}, ` +
        `reserved ${formatBytes(d.reserved_bytes)}, total ${formatBytes(d.total_bytes)}`
    );
  }
  lines.push(`Kernel process RSS: ${formatBytes(payload.host?.rss_bytes)}`);
  lines.push('Click to open the GPU memory sidebar.');
  return lines.join('\n');
}

/** The last part of a document's path: "train.ipynb" for "runs/train.ipynb". */
export function baseName(path: string): string {
  const parts = path.split('/');
  return parts[parts.length - 1] || path;
}

/** What became of a kernel in each status that ends its gpumem (a restarted kernel starts without it). */
const KERNEL_GONE: Readonly<Record<string, string>> = {
  restarting: 'restarted',
  autorestarting: 'restarted',
  dead: 'died',
  terminating: 'was shut down'
};

/**
 * What became of a kernel now in `status` (a Kernel.Status): "restarted",
 * "died" or "was shut down"; null while the gpumem it ran still runs.
 */
export function kernelGone(status: string): string | null {
  return Object.prototype.hasOwnProperty.call(KERNEL_GONE, status)
    ? KERNEL_GONE[status]
    : null;
}

/**
 * What the sidebar says once the kernel of `name` is gone: `what` became of
 * it ("restarted", "died", "was shut down" or "changed").
 */
export function reconnectMessage(name: string, what: string): string {
  const where = what === 'died' ? ' in a new kernel' : '';
  return `The kernel of ${name} ${what}; run %load_ext gpumem, then %gpumem sidebar${where} to reconnect.`;
}
