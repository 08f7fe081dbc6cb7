import { IDeviceStatus, IStatusPayload } from './protocol';

const GIB = 1024 ** 3;
const MIB = 1024 ** 2;

/** A byte count as a short number in GiB (or MiB below 1 GiB), with unit. */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !isFinite(bytes)) {
    return '?';
  }
  if (Math.abs(bytes) >= GIB) {
    const gib = bytes / GIB;
    return `${gib >= 100 ? gib.toFixed(0) : gib.toFixed(1)} GiB`;
  }
  return `${(bytes / MIB).toFixed(0)} MiB`;
}

/** The number only, in GiB, for "used / total GiB" figures. */
function gib(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !isFinite(bytes)) {
    return '?';
  }
  const value = bytes / GIB;
  return value >= 100 ? value.toFixed(0) : value.toFixed(1);
}

/** Devices worth showing: those PyTorch holds memory on, else the first. */
function shownDevices(payload: IStatusPayload): IDeviceStatus[] {
  const used = payload.devices.filter(
    d => (d.reserved_bytes ?? d.allocated_bytes) > 0
  );
  if (used.length) {
    return used;
  }
  return payload.devices.slice(0, 1);
}

/** The status-bar text, e.g. "GPU 3.2 / 140 GiB" or "RAM 1.3 GiB (no GPU in use)". */
export function statusText(payload: IStatusPayload): string {
  const devices = payload.cuda_in_use ? shownDevices(payload) : [];
  if (!devices.length) {
    return `RAM ${formatBytes(payload.host?.rss_bytes)} (no GPU in use)`;
  }
  if (devices.length === 1) {
    const d = devices[0];
    return `GPU ${gib(d.allocated_bytes)} / ${gib(d.total_bytes)} GiB`;
  }
  const allocated = devices.reduce((s, d) => s + d.allocated_bytes, 0);
  const total = devices.reduce((s, d) => s + (d.total_bytes ?? NaN), 0);
  return `GPU ×${devices.length} ${gib(allocated)} / ${gib(total)} GiB`;
}

/** A multi-line tooltip with every device and the host figure. */
export function statusTooltip(payload: IStatusPayload, where: string): string {
  const lines = [`GPU memory of ${where} (PyTorch allocator)`];
  if (!payload.cuda_in_use) {
    lines.push('No CUDA device in use in this kernel.');
  }
  for (const d of payload.cuda_in_use ? payload.devices : []) {
    lines.push(
      `cuda:${d.index}${d.name ? ' ' + d.name : ''}: allocated ${formatBytes(
        d.allocated_bytes
      )}, reserved ${formatBytes(d.reserved_bytes)}, total ${formatBytes(
        d.total_bytes
      )}`
    );
  }
  lines.push(`Kernel process RSS: ${formatBytes(payload.host?.rss_bytes)}`);
  lines.push('Click to open the GPU memory sidebar.');
  return lines.join('\n');
}
