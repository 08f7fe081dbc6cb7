import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import {
  baseName,
  formatBytes,
  kernelGone,
  reconnectMessage,
  statusText,
  statusTooltip
} from '../src/format';
import type { IDeviceStatus, IStatusPayload } from '../src/protocol';
import { readFixture } from './fixtures';

const GIB = 1024 ** 3;
const MIB = 1024 ** 2;

interface IBytesCase {
  bytes: number | 'nan' | 'inf' | '-inf';
  precision?: number;
  text: string;
}

/** JSON has no NaN or infinities: the fixture spells them as Python's float() reads them. */
const SPECIAL: Record<string, number> = {
  nan: NaN,
  inf: Infinity,
  '-inf': -Infinity
};

describe('formatBytes', () => {
  const { cases } = readFixture<{ cases: IBytesCase[] }>('format_bytes.json');

  it('reads the shared cases', () => {
    assert.ok(cases.length >= 30, `only ${cases.length} shared cases`);
  });

  for (const c of cases) {
    it(`writes ${String(c.bytes)} (precision ${c.precision ?? 1}) as Python does: ${c.text}`, () => {
      const bytes = typeof c.bytes === 'string' ? SPECIAL[c.bytes] : c.bytes;
      assert.equal(typeof bytes, 'number');
      assert.equal(formatBytes(bytes, c.precision), c.text);
    });
  }

  it('writes a figure the kernel did not know as n/a, as the panel does', () => {
    assert.equal(formatBytes(null), 'n/a');
    assert.equal(formatBytes(undefined), 'n/a');
  });

  it('rounds every tie of a tenth of a KiB to even, as Python does', () => {
    // k + 0.25 and k + 0.75 KiB are exact ties at one decimal.
    for (let k = 1; k < 1024; k++) {
      const down = formatBytes((k + 0.25) * 1024);
      const up = formatBytes((k + 0.75) * 1024);
      assert.equal(down, `${k}.2 KiB`);
      assert.equal(up, `${k}.8 KiB`);
    }
  });
});

function device(over: Partial<IDeviceStatus> = {}): IDeviceStatus {
  return {
    index: 0,
    name: 'NVIDIA H200',
    allocated_bytes: 3.2 * GIB,
    reserved_bytes: 4 * GIB,
    total_bytes: 140 * GIB,
    ...over
  };
}

function payload(over: Partial<IStatusPayload> = {}): IStatusPayload {
  return {
    devices: [device()],
    host: { rss_bytes: 1.3 * GIB },
    cuda_in_use: true,
    ...over
  };
}

describe('statusText', () => {
  it('shows the one device in use with its capacity', () => {
    assert.equal(statusText(payload()), 'GPU 3.2 GiB / 140.0 GiB');
  });

  it('shows the host when no GPU is in use', () => {
    assert.equal(
      statusText(payload({ cuda_in_use: false })),
      'RAM 1.3 GiB (no GPU in use)'
    );
    assert.equal(
      statusText(payload({ cuda_in_use: false, host: {} })),
      'RAM n/a (no GPU in use)'
    );
    assert.equal(
      statusText(payload({ devices: [] })),
      'RAM 1.3 GiB (no GPU in use)'
    );
  });

  it('adds up the devices that hold memory and leaves out the others', () => {
    const idle = device({ index: 2, allocated_bytes: 0, reserved_bytes: 0 });
    const second = device({ index: 1, allocated_bytes: 0.8 * GIB });
    assert.equal(
      statusText(payload({ devices: [device(), idle, second] })),
      'GPU ×2 4.0 GiB / 280.0 GiB'
    );
  });

  it('shows the first device when none holds memory', () => {
    const idle = (index: number) =>
      device({ index, allocated_bytes: 0, reserved_bytes: 0 });
    assert.equal(
      statusText(payload({ devices: [idle(0), idle(1)] })),
      'GPU 0 B / 140.0 GiB'
    );
  });

  it('leaves out a capacity it does not know rather than guess it', () => {
    assert.equal(
      statusText(payload({ devices: [device({ total_bytes: null })] })),
      'GPU 3.2 GiB'
    );
    const unknown = device({ index: 1, total_bytes: undefined });
    assert.equal(
      statusText(payload({ devices: [device(), unknown] })),
      'GPU ×2 6.4 GiB'
    );
  });

  it('counts allocated memory when the reserved figure is missing', () => {
    const d = device({ reserved_bytes: undefined, allocated_bytes: 512 * MIB });
    assert.equal(
      statusText(payload({ devices: [d] })),
      'GPU 512.0 MiB / 140.0 GiB'
    );
  });
});

describe('statusTooltip', () => {
  it('lists every device, then the host', () => {
    const idle = device({
      index: 1,
      name: undefined,
      allocated_bytes: 0,
      reserved_bytes: 0
    });
    assert.equal(
      statusTooltip(payload({ devices: [device(), idle] }), 'train.ipynb'),
      [
        'GPU memory of train.ipynb (PyTorch allocator)',
        'cuda:0 NVIDIA H200: allocated 3.2 GiB, reserved 4.0 GiB, total 140.0 GiB',
        'cuda:1: allocated 0 B, reserved 0 B, total 140.0 GiB',
        'Kernel process RSS: 1.3 GiB',
        'Click to open the GPU memory sidebar.'
      ].join('\n')
    );
  });

  it('says when no CUDA device is in use', () => {
    assert.equal(
      statusTooltip(payload({ cuda_in_use: false }), 'a console'),
      [
        'GPU memory of a console (PyTorch allocator)',
        'No CUDA device in use in this kernel.',
        'Kernel process RSS: 1.3 GiB',
        'Click to open the GPU memory sidebar.'
      ].join('\n')
    );
  });
});

describe('baseName', () => {
  it('keeps the last part of a path', () => {
    assert.equal(baseName('runs/2026/train.ipynb'), 'train.ipynb');
    assert.equal(baseName('train.ipynb'), 'train.ipynb');
    assert.equal(baseName('runs/'), 'runs/');
    assert.equal(baseName(''), '');
  });
});

describe('a kernel that went away', () => {
  it('is gone in the statuses that end its gpumem, and only those', () => {
    assert.equal(kernelGone('restarting'), 'restarted');
    assert.equal(kernelGone('autorestarting'), 'restarted');
    assert.equal(kernelGone('dead'), 'died');
    assert.equal(kernelGone('terminating'), 'was shut down');
    for (const status of [
      'idle',
      'busy',
      'starting',
      'unknown',
      'connecting',
      'toString'
    ]) {
      assert.equal(kernelGone(status), null, status);
    }
  });

  it('says what to run to reconnect', () => {
    assert.equal(
      reconnectMessage('train.ipynb', 'restarted'),
      'The kernel of train.ipynb restarted; run %load_ext gpumem, then %gpumem sidebar to reconnect.'
    );
    assert.equal(
      reconnectMessage('train.ipynb', 'died'),
      'The kernel of train.ipynb died; run %load_ext gpumem, then %gpumem sidebar in a new kernel to reconnect.'
    );
  });
});
